//go:build linux

package main

import (
	"syscall"
	"unsafe"
)

// sendQueue returns the bytes in the connection's socket send queue,
// written but not yet acknowledged by the client (TIOCOUTQ, SIOCOUTQ), or
// false when it has no socket to ask. It does not allocate: the ioctl's
// function and result live in the connection (one request at a time uses
// it).
func (c *clientConn) sendQueue() (int64, bool) {
	if c.raw == nil {
		return 0, false
	}
	if c.outq.fn == nil {
		c.outq.fn = func(fd uintptr) {
			_, _, c.outq.errno = syscall.Syscall(syscall.SYS_IOCTL, fd, syscall.TIOCOUTQ, uintptr(unsafe.Pointer(&c.outq.n)))
		}
	}
	if err := c.raw.Control(c.outq.fn); err != nil || c.outq.errno != 0 {
		return 0, false
	}
	return int64(c.outq.n), true
}
