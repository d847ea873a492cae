package kvroute

import "github.com/bidikv/bidikv/internal/jsonraw"

// reqBool reads a boolean request flag.
func reqBool(v []byte) (bool, bool) { return jsonraw.Bool(v) }

// reqInt reads an integer request field.
func reqInt(v []byte) (int64, bool) { return jsonraw.Int(v) }
