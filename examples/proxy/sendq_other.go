//go:build !linux

package main

import "syscall"

// sendQueue reports false: only Linux tells the unacknowledged bytes of a
// socket here, so elsewhere only the per-write deadline bounds a client
// that stops reading.
func sendQueue(syscall.RawConn) (int64, bool) { return 0, false }
