// Package durflag is the one rule of the duration flags of bidikv's
// commands (the proxy, bench): no duration flag takes a negative value,
// those whose 0 means nothing take none either, and an error names the
// flag and its value as it was written ("--prefill-timeout -5s: must not
// be negative"), not as Go formats a duration.
package durflag

import (
	"flag"
	"fmt"
	"slices"
	"strings"
	"time"
)

// duration returns f's value when f is a duration flag.
func duration(f *flag.Flag) (time.Duration, bool) {
	g, ok := f.Value.(flag.Getter)
	if !ok {
		return 0, false
	}
	d, ok := g.Get().(time.Duration)
	return d, ok
}

// Names lists the duration flags of fs, sorted.
func Names(fs *flag.FlagSet) []string {
	var out []string
	fs.VisitAll(func(f *flag.Flag) {
		if _, ok := duration(f); ok {
			out = append(out, f.Name)
		}
	})
	return out
}

// Check applies the rule to fs once fs.Parse(args) succeeded: the first
// duration flag (in name order) set to a negative value, or to 0 when
// positive names it, is an error naming it and its value as args gave it
// ("--name VALUE: must not be negative", "--name VALUE: must be
// positive").
func Check(fs *flag.FlagSet, args []string, positive ...string) error {
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		d, ok := duration(f)
		if !ok || err != nil {
			return
		}
		switch {
		case d < 0:
			err = fmt.Errorf("--%s %s: must not be negative", f.Name, given(fs, args, f.Name, d))
		case d == 0 && slices.Contains(positive, f.Name):
			err = fmt.Errorf("--%s %s: must be positive", f.Name, given(fs, args, f.Name, d))
		}
	})
	return err
}

// given returns the text args set flag name to (the last time, as the
// flag package takes it), else d as Go writes it.
func given(fs *flag.FlagSet, args []string, name string, d time.Duration) string {
	shown := d.String()
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" || !strings.HasPrefix(a, "-") {
			break // the flag package stops here
		}
		n, v, eq := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "=")
		switch {
		case n != name:
		case eq:
			shown = v
		case i+1 < len(args):
			shown = args[i+1]
		}
		if !eq && !isBool(fs.Lookup(n)) {
			i++ // the flag's value follows it
		}
	}
	return shown
}

// isBool reports whether f takes no value (a boolean flag).
func isBool(f *flag.Flag) bool {
	if f == nil {
		return false
	}
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}
