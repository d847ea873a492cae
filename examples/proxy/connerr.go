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

// jsonErrorConn rewrites net/http's plain-text parse errors into JSON, so
// that every error the proxy emits is JSON: Anthropic's error shape when
// the request line of the failed request named /v1/messages or a path
// below it, OpenAI's otherwise. net/http writes each such error with one
// Write on the connection, then closes it; it has read the request line
// by then, so the connection's reads tell which API it was for.
type jsonErrorConn struct {
	net.Conn
	lines requestLines
}

func (c *jsonErrorConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.lines.scan(p[:n])
	return n, err
}

// requestLines follows the lines a connection reads and remembers whether
// the last one that looked like a request line ("METHOD /path ...") was
// for Anthropic's API. It keeps at most maxLineStart bytes of a line.
type requestLines struct {
	start     []byte // the start of the current line
	midLine   bool   // past the kept start of the current line
	anthropic bool
}

// maxLineStart is what a request line needs to tell its path: a method
// and "/v1/messages" followed by a space, '?' or '/'.
const maxLineStart = 32

func (l *requestLines) scan(b []byte) {
	for len(b) > 0 {
		i := bytes.IndexByte(b, '\n')
		if !l.midLine {
			part := b
			if i >= 0 {
				part = b[:i]
			}
			part = part[:min(len(part), maxLineStart-len(l.start))]
			l.start = append(l.start, part...)
			if i >= 0 || len(l.start) == maxLineStart {
				l.requestLine()
				l.midLine = true
			}
		}
		if i < 0 {
			return
		}
		b = b[i+1:]
		l.start, l.midLine = l.start[:0], false
	}
}

// requestLine notes the kept start of a line if it is a request line.
func (l *requestLines) requestLine() {
	method, rest, ok := bytes.Cut(l.start, []byte(" "))
	if !ok || len(method) == 0 || bytes.ContainsAny(method, ":\t\r") || len(rest) == 0 || rest[0] != '/' {
		return
	}
	end := bytes.IndexAny(rest, " ?\r")
	if end < 0 {
		end = len(rest)
	}
	l.anthropic = anthropicPath(string(rest[:end]))
}

func (c *jsonErrorConn) Write(p []byte) (int, error) {
	if b, ok := rewriteNetHTTPError(p, c.lines.anthropic); ok {
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
// responses (in Anthropic's shape when anthropic is set), or false when p
// is not one.
func rewriteNetHTTPError(p []byte, anthropic bool) ([]byte, bool) {
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
	if anthropic {
		body = anthropicErrorBody(status, text)
	}
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
