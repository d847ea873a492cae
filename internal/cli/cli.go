// Package cli holds what the repository's commands (the proxy, vllmsim,
// bench, the demo) share on their command line: --help by group, the
// nearest flag for a typo, and whether an output is a terminal.
package cli

import (
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
)

// Group is a titled group of flags in --help. A flag's aliases follow it
// after a comma ("prefiller-hosts,prefiller-host"). A group without a
// title hides its flags (a mode's own switch, say).
type Group struct {
	Title string
	Flags []string
}

// WriteHelp writes head, then fs's flags by group, each flag once with its
// aliases on its line; flags in no group are listed last under "Other".
// value names a flag's argument in the listing (as "SIZE"); "" keeps the
// flag package's name (flag.UnquoteUsage). value may be nil.
func WriteHelp(w io.Writer, fs *flag.FlagSet, head string, groups []Group, value func(*flag.Flag) string) {
	fmt.Fprint(w, head)
	listed := map[string]bool{}
	for _, g := range groups {
		if g.Title == "" {
			for _, spec := range g.Flags {
				for _, name := range strings.Split(spec, ",") {
					listed[name] = true
				}
			}
			continue
		}
		var names [][]string
		for _, spec := range g.Flags {
			n := strings.Split(spec, ",")
			if fs.Lookup(n[0]) != nil {
				names = append(names, n)
			}
		}
		if len(names) == 0 {
			continue
		}
		fmt.Fprintf(w, "\n%s:\n", g.Title)
		for _, n := range names {
			for _, name := range n {
				listed[name] = true
			}
			writeFlag(w, fs.Lookup(n[0]), value, n[1:])
		}
	}
	var other []*flag.Flag
	fs.VisitAll(func(f *flag.Flag) {
		if !listed[f.Name] {
			other = append(other, f)
		}
	})
	if len(other) > 0 {
		fmt.Fprintf(w, "\nOther:\n")
		for _, f := range other {
			writeFlag(w, f, value, nil)
		}
	}
}

// writeFlag writes one flag: its names and argument, then its usage
// wrapped to 80 columns with its default.
func writeFlag(w io.Writer, f *flag.Flag, value func(*flag.Flag) string, aliases []string) {
	arg, usage := flag.UnquoteUsage(f)
	if value != nil {
		if v := value(f); v != "" {
			arg = v
		}
	}
	line := "  --" + f.Name
	if arg != "" {
		line += " " + arg
	}
	for _, a := range aliases {
		line += ", --" + a
	}
	fmt.Fprintln(w, line)
	if def := f.DefValue; def != "" && def != "false" && def != "0" && def != "[]" {
		usage += " (default " + def + ")"
	}
	const width = 80
	var cur strings.Builder
	for _, word := range strings.Fields(usage) {
		if cur.Len() > 0 && cur.Len()+1+len(word) > width-6 {
			fmt.Fprintln(w, "      "+cur.String())
			cur.Reset()
		}
		if cur.Len() > 0 {
			cur.WriteByte(' ')
		}
		cur.WriteString(word)
	}
	if cur.Len() > 0 {
		fmt.Fprintln(w, "      "+cur.String())
	}
}

// UnknownFlag returns the name of the flag a flag.FlagSet's parse error
// reports as undefined, without its dashes.
func UnknownFlag(err error) (string, bool) {
	if err == nil {
		return "", false
	}
	name, ok := strings.CutPrefix(err.Error(), "flag provided but not defined: ")
	return strings.TrimLeft(name, "-"), ok
}

// Closest returns the flag of fs nearest to name (an edit distance of at
// most a third of its length, and at least 2), or else a flag that name
// is part of; "" when none is close.
func Closest(fs *flag.FlagSet, name string) string {
	name = strings.ToLower(name)
	best, bestD := "", math.MaxInt
	fs.VisitAll(func(f *flag.Flag) {
		d := editDistance(name, f.Name)
		if d < bestD || (d == bestD && f.Name < best) {
			best, bestD = f.Name, d
		}
	})
	if bestD <= max(2, len(name)/3) {
		return best
	}
	var part []string
	fs.VisitAll(func(f *flag.Flag) {
		if len(name) >= 4 && strings.Contains(f.Name, name) {
			part = append(part, f.Name)
		}
	})
	if len(part) > 0 {
		slices.Sort(part)
		return part[0]
	}
	return ""
}

// editDistance is Levenshtein's distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// IsTerminal reports whether w is a file on a character device (a
// terminal): progress lines and redrawn bars go there, never to a file or
// a pipe a run's output is redirected to.
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok || f == nil {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
