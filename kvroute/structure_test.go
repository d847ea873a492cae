package kvroute_test

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// The limits of kvroute's structure (issue 22): its non-test code reads as
// a pipeline of small phases, not one type every phase mutates. Measured
// by this test, which anyone can run:
//
//	go test -run TestStructure -v ./kvroute
const (
	maxMethods     = 15  // methods of one type
	maxMethodFiles = 3   // files holding the methods of one unexported type
	maxFileLines   = 500 // lines of one non-test file
	maxFuncLines   = 80  // lines of one function, its signature and braces included
	maxExported    = 170 // exported identifiers (see countExported)
	maxOptions     = 24  // exported With... functions
	// maxTopFiles bounds kvroute's non-test files at its top level: the
	// pipeline and the public API; concerns that keep their own state
	// (the engine client, the /metrics page, ...) live in internal
	// packages.
	maxTopFiles = 35
)

// structureEnforced turns the limits from a report into failures (false
// while the refactoring of issue 22 was under way).
const structureEnforced = true

// TestStructure measures kvroute's non-test files (and the file, function
// and method limits in its internal packages, so that code moved there is
// held to them too). Exported identifiers are the top-level exported
// types, functions, constants and variables, plus the exported methods of
// exported types; struct fields are not counted.
func TestStructure(t *testing.T) {
	s := measure(t, ".")
	if s.files > maxTopFiles {
		s.problem("kvroute: %d non-test files at the top level (limit %d)", s.files, maxTopFiles)
	}
	dirs, _ := filepath.Glob("internal/*")
	for _, d := range dirs {
		if fi, err := os.Stat(d); err == nil && fi.IsDir() {
			sub := measure(t, d)
			sub.typeRules(d)
			s.problems = append(s.problems, sub.problems...)
		}
	}
	s.typeRules("kvroute")
	if s.exported > maxExported {
		s.problem("exported identifiers: %d (limit %d)", s.exported, maxExported)
	}
	if s.options > maxOptions {
		s.problem("With options: %d (limit %d)", s.options, maxOptions)
	}
	t.Logf("kvroute: %d non-test files, %d lines; %d exported identifiers (limit %d), %d With options (limit %d)",
		s.files, s.lines, s.exported, maxExported, s.options, maxOptions)
	for _, p := range s.problems {
		if structureEnforced {
			t.Error(p)
		} else {
			t.Log(p)
		}
	}
}

type structure struct {
	files, lines      int
	methods           map[string]int
	methodFiles       map[string]map[string]bool
	exported, options int
	problems          []string
}

// typeRules checks the types of package pkg: at most maxMethods methods
// each; an unexported type's methods in at most maxMethodFiles files (in
// an internal package, any type's: its exported names are still the
// package's own).
func (s *structure) typeRules(pkg string) {
	internal := pkg != "kvroute"
	var types []string
	for k := range s.methods {
		types = append(types, k)
	}
	sort.Strings(types)
	for _, typ := range types {
		if s.methods[typ] > maxMethods {
			s.problem("%s: type %s: %d methods (limit %d)", pkg, typ, s.methods[typ], maxMethods)
		}
		if (internal || !ast.IsExported(typ)) && len(s.methodFiles[typ]) > maxMethodFiles {
			s.problem("%s: type %s: methods in %d files (limit %d)", pkg, typ, len(s.methodFiles[typ]), maxMethodFiles)
		}
	}
}

func (s *structure) problem(format string, args ...any) {
	s.problems = append(s.problems, fmt.Sprintf(format, args...))
}

// measure parses the non-test Go files of dir.
func measure(t *testing.T, dir string) *structure {
	t.Helper()
	s := &structure{methods: map[string]int{}, methodFiles: map[string]map[string]bool{}}
	fset := token.NewFileSet()
	files, _ := filepath.Glob(filepath.Join(dir, "*.go"))
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		s.files++
		lines := strings.Count(string(src), "\n")
		s.lines += lines
		if lines > maxFileLines {
			s.problem("%s: %d lines (limit %d)", f, lines, maxFileLines)
		}
		af, err := parser.ParseFile(fset, f, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range af.Decls {
			s.decl(fset, f, d)
		}
	}
	return s
}

func (s *structure) decl(fset *token.FileSet, f string, d ast.Decl) {
	switch d := d.(type) {
	case *ast.FuncDecl:
		n := fset.Position(d.End()).Line - fset.Position(d.Pos()).Line + 1
		if n > maxFuncLines {
			s.problem("%s: func %s: %d lines (limit %d)", f, d.Name.Name, n, maxFuncLines)
		}
		if d.Recv != nil {
			typ := recvName(d.Recv.List[0].Type)
			s.methods[typ]++
			if s.methodFiles[typ] == nil {
				s.methodFiles[typ] = map[string]bool{}
			}
			s.methodFiles[typ][f] = true
			if d.Name.IsExported() && ast.IsExported(typ) {
				s.exported++
			}
			return
		}
		if d.Name.IsExported() {
			s.exported++
			if strings.HasPrefix(d.Name.Name, "With") {
				s.options++
			}
		}
	case *ast.GenDecl:
		for _, sp := range d.Specs {
			switch sp := sp.(type) {
			case *ast.TypeSpec:
				if sp.Name.IsExported() {
					s.exported++
				}
			case *ast.ValueSpec:
				for _, n := range sp.Names {
					if n.IsExported() {
						s.exported++
					}
				}
			}
		}
	}
}

func recvName(e ast.Expr) string {
	switch e := e.(type) {
	case *ast.StarExpr:
		return recvName(e.X)
	case *ast.IndexExpr:
		return recvName(e.X)
	case *ast.IndexListExpr:
		return recvName(e.X)
	case *ast.Ident:
		return e.Name
	}
	return "?"
}
