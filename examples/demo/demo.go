package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/bidikv/bidikv/internal/cli"
)

// runMain parses args, runs both modes, prints the tables and writes the
// chart.
func runMain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parseFlags(args, stdout)
	if err != nil {
		return err
	}
	start := time.Now()
	// The bar redraws one line with \r: only on a terminal, never into a
	// file or a pipe stderr is redirected to.
	var bar io.Writer
	if c.progress && cli.IsTerminal(stderr) {
		bar = stderr
	}
	s, err := run(ctx, c, bar)
	if err != nil {
		return err
	}
	s.print(stdout)
	s.printPauses(stdout)
	if c.svg != "" {
		f, err := os.Create(c.svg)
		if err != nil {
			return err
		}
		if err := writeSVG(f, s); err != nil {
			_ = f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "chart: %s\n", c.svg)
	}
	fmt.Fprintf(stdout, "done in %s\n", time.Since(start).Round(100*time.Millisecond))
	return nil
}

// run runs the conversations with reuse off, then on, and summarizes.
func run(ctx context.Context, c config, bar io.Writer) (summary, error) {
	p := &progress{w: bar, total: (2 + len(c.pauses)) * c.conversations * c.turns}
	p.setLabel("reuse off")
	off, err := runMode(ctx, c, false, p.tick)
	if err != nil {
		return summary{}, err
	}
	p.setLabel("reuse on")
	on, err := runMode(ctx, c, true, p.tick)
	if err != nil {
		return summary{}, err
	}
	s := summarize(c, off, on)
	for _, d := range c.pauses {
		p.setLabel("pause " + d.String())
		row, err := runPause(ctx, c, d, p.tick)
		if err != nil {
			return summary{}, err
		}
		s.pauses = append(s.pauses, row)
	}
	return s, nil
}
