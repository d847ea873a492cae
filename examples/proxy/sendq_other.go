//go:build !linux

package main

// sendQueue reports false: only Linux tells the unacknowledged bytes of a
// socket here, so elsewhere only the per-write deadline bounds a client
// that stops reading.
func (c *clientConn) sendQueue() (int64, bool) { return 0, false }
