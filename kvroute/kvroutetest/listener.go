package kvroutetest

import (
	"net"
	"sync/atomic"
)

// refuser is a listener that accepts and at once closes every new
// connection while refusing is on.
type refuser struct {
	net.Listener
	refusing atomic.Bool
}

func (l *refuser) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if !l.refusing.Load() {
			return c, nil
		}
		_ = c.Close()
	}
}
