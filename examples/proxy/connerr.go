package main

import (
	"bytes"
	"net"
	"net/http"
	"strconv"
)

// netHTTPErrorHeaders is what net/http writes after the status line when it
// answers a request it could not parse, before any handler runs (a header
// block above MaxHeaderBytes, a bad Content-Length, a missing Host, an
// unsupported Transfer-Encoding or HTTP version). Handler responses always
// carry a Date header, so they never match.
const netHTTPErrorHeaders = "\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"

// jsonErrorConn rewrites net/http's plain-text parse errors into OpenAI's
// JSON error shape, so that every error the proxy emits is JSON. net/http
// writes each such error with one Write on the connection, then closes it.
type jsonErrorConn struct{ net.Conn }

func (c *jsonErrorConn) Write(p []byte) (int, error) {
	if b, ok := rewriteNetHTTPError(p); ok {
		if _, err := c.Conn.Write(b); err != nil {
			return 0, err
		}
		return len(p), nil
	}
	return c.Conn.Write(p)
}

// CloseWrite lets net/http half-close after a 431, as on a plain TCP
// connection.
func (c *jsonErrorConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// rewriteNetHTTPError returns the JSON form of one of net/http's own error
// responses, or false when p is not one.
func rewriteNetHTTPError(p []byte) ([]byte, bool) {
	const proto = "HTTP/1.1 "
	if !bytes.HasPrefix(p, []byte(proto)) || len(p) < len(proto)+3 {
		return nil, false
	}
	line, rest, ok := bytes.Cut(p, []byte("\r\n"))
	if !ok || !bytes.HasPrefix(rest, []byte(netHTTPErrorHeaders[2:])) {
		return nil, false
	}
	status, err := strconv.Atoi(string(line[len(proto) : len(proto)+3]))
	if err != nil || status < 400 || status > 599 {
		return nil, false
	}
	text := string(rest[len(netHTTPErrorHeaders)-2:])
	body := errorBody(status, text)
	out := make([]byte, 0, len(line)+len(body)+96)
	out = append(out, proto...)
	out = strconv.AppendInt(out, int64(status), 10)
	out = append(out, ' ')
	out = append(out, http.StatusText(status)...)
	out = append(out, "\r\nContent-Type: application/json\r\nContent-Length: "...)
	out = strconv.AppendInt(out, int64(len(body)), 10)
	out = append(out, "\r\nConnection: close\r\n\r\n"...)
	return append(out, body...), true
}
