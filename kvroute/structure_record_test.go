package kvroute_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// recordReaders are the files that may read the fields of a turn's
// TurnRecord: the record's own (observer.go). Phases hand each other what
// a later phase needs in their results (hit, way, prefilled, answer, the
// retainer Do owns); the record is only written by them, and read by the
// Observer and the Tracer it is handed to when the turn ends.
var recordReaders = map[string]bool{"observer.go": true}

// TestStructureRecordWrittenOnly fails on any read of a TurnRecord field
// (rec.X, t.rec.X, ...) in kvroute's non-test files outside recordReaders.
// A write is the target of an assignment (x.rec.F = v, x.rec.F.G = v) or
// an accumulation (x.rec.F += n, x.rec.F++): its value goes nowhere else.
// Anything else (a condition, an argument, &x.rec.F, the right-hand side
// of an assignment) is a read.
func TestStructureRecordWrittenOnly(t *testing.T) {
	fset := token.NewFileSet()
	files, _ := filepath.Glob("*.go")
	parsed := map[string]*ast.File{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(fset, f, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		parsed[f] = af
	}
	fields := turnRecordFields(t, parsed)
	var reads []string
	for f, af := range parsed {
		if recordReaders[f] {
			continue
		}
		for _, sel := range recordFieldReads(af, fields) {
			reads = append(reads, fset.Position(sel.Pos()).String()+": reads the record's "+sel.Sel.Name)
		}
	}
	sort.Strings(reads)
	for _, r := range reads {
		t.Error(r)
	}
}

// turnRecordFields returns the names of TurnRecord's fields.
func turnRecordFields(t *testing.T, parsed map[string]*ast.File) map[string]bool {
	t.Helper()
	fields := map[string]bool{}
	for _, af := range parsed {
		ast.Inspect(af, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok || ts.Name.Name != "TurnRecord" {
				return true
			}
			for _, fl := range ts.Type.(*ast.StructType).Fields.List {
				for _, name := range fl.Names {
					fields[name.Name] = true
				}
			}
			return false
		})
	}
	if len(fields) == 0 {
		t.Fatal("type TurnRecord not found")
	}
	return fields
}

// recordFieldReads returns the selectors rec.F and x.rec.F of af (F a
// TurnRecord field) that are not written to.
func recordFieldReads(af *ast.File, fields map[string]bool) []*ast.SelectorExpr {
	written := map[*ast.SelectorExpr]bool{}
	target := func(e ast.Expr) {
		// x.rec.F.G = v writes x.rec.F: strip the selectors and indexes
		// down to the record's field.
		for {
			if sel, ok := e.(*ast.SelectorExpr); ok && isRecord(sel.X) {
				written[sel] = true
				return
			}
			switch x := e.(type) {
			case *ast.SelectorExpr:
				e = x.X
			case *ast.IndexExpr:
				e = x.X
			case *ast.ParenExpr:
				e = x.X
			default:
				return
			}
		}
	}
	var sels []*ast.SelectorExpr
	ast.Inspect(af, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.AssignStmt:
			if n.Tok != token.DEFINE {
				for _, l := range n.Lhs {
					target(l)
				}
			}
		case *ast.IncDecStmt:
			target(n.X)
		case *ast.SelectorExpr:
			if isRecord(n.X) && fields[n.Sel.Name] {
				sels = append(sels, n)
			}
		}
		return true
	})
	var reads []*ast.SelectorExpr
	for _, s := range sels {
		if !written[s] {
			reads = append(reads, s)
		}
	}
	return reads
}

// isRecord reports whether e names a turn's record: rec, or x.rec.
func isRecord(e ast.Expr) bool {
	switch e := e.(type) {
	case *ast.Ident:
		return e.Name == "rec"
	case *ast.SelectorExpr:
		return e.Sel.Name == "rec"
	}
	return false
}
