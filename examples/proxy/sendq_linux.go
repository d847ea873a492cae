//go:build linux

package main

import (
	"syscall"
	"unsafe"
)

// sendQueue returns the bytes in the socket's send queue, written but not
// yet acknowledged by the peer (TIOCOUTQ, SIOCOUTQ), or false when the
// connection has no socket to ask.
func sendQueue(rc syscall.RawConn) (int64, bool) {
	if rc == nil {
		return 0, false
	}
	var n int32
	var errno syscall.Errno
	err := rc.Control(func(fd uintptr) {
		_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, fd, syscall.TIOCOUTQ, uintptr(unsafe.Pointer(&n)))
	})
	if err != nil || errno != 0 {
		return 0, false
	}
	return int64(n), true
}
