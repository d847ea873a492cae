package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/bidikv/bidikv/internal/cli"
)

// modes are bench's modes besides the default one, in --help's order:
// the flag that selects each and what it does, one line each.
var modes = []struct{ flag, what string }{
	{"", "multi-turn load on --url from --input: TTFT, TPOT, hit rate"},
	{"--overhead", "the router's own CPU and added TTFT per turn, vs direct P→D"},
	{"--fleet", "agent sessions on engines with KV capacity: decode memory"},
	{"--replay-trace", "the Mooncake trace against decode-memory policies"},
	{"--attack", "denial-of-service attacks on a proxy, a good client served"},
}

// synopsis opens `bench --help`.
func synopsis() string {
	var b strings.Builder
	b.WriteString(`Usage: bench --url URL --input FILE [flags]
       bench --overhead | --fleet | --replay-trace [FILE] | --attack [flags]

Modes:
`)
	for _, m := range modes {
		name := m.flag
		if name == "" {
			name = "(default)"
		}
		fmt.Fprintf(&b, "  %-15s %s\n", name, m.what)
	}
	b.WriteString("\n`bench MODE --help` lists a mode's flags. The exit status is 1 when every\n" +
		"request failed (the first error is printed) or a target FAILed.\n")
	return b.String()
}

// newFlagSet is a mode's flag set: it writes nothing itself (flagError
// does).
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// flagError is a mode's fs.Parse error for the user: --help's text written
// to help (the error is then flag.ErrHelp, exit status 0), an unknown flag
// named with the nearest known one.
func flagError(fs *flag.FlagSet, err error, help io.Writer) error {
	mode := strings.TrimPrefix(fs.Name(), "bench ")
	if errors.Is(err, flag.ErrHelp) {
		head := synopsis()
		title := "Flags of the default mode"
		if mode != "bench" {
			head = "Usage: " + fs.Name() + " [flags]\n\n"
			for _, m := range modes {
				if m.flag == mode {
					head += strings.ToUpper(m.what[:1]) + m.what[1:] + ".\n"
				}
			}
			title = "Flags"
		}
		var names []string
		fs.VisitAll(func(f *flag.Flag) {
			if "--"+f.Name != mode {
				names = append(names, f.Name)
			}
		})
		groups := []cli.Group{{Title: title, Flags: names}, {Flags: []string{strings.TrimPrefix(mode, "--")}}}
		cli.WriteHelp(help, fs, head, groups, nil)
		return err
	}
	if name, ok := cli.UnknownFlag(err); ok {
		hint := ""
		if s := cli.Closest(fs, name); s != "" {
			hint = " (did you mean --" + s + "?)"
		}
		return fmt.Errorf("unknown flag --%s%s; %s --help lists the flags", name, hint, fs.Name())
	}
	return err
}
