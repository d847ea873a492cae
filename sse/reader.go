package sse

import (
	"bytes"
	"errors"
	"io"
	"strconv"
	"time"
)

// ErrEventTooLarge is returned by Reader.Next when an event exceeds the
// maximum size (see WithMaxEventSize).
var ErrEventTooLarge = errors.New("sse: event too large")

const (
	initialBufSize = 4 << 10
	minRead        = 2 << 10
	maxEmptyReads  = 100
	bom            = "\xef\xbb\xbf"
)

// Reader splits an SSE byte stream into events.
//
// Lines end in "\n", "\r" or "\r\n" (also when the pair is split across
// reads). Lines starting with ':' are comments. The fields data, event, id
// and retry are recognised, with an optional single space after the colon;
// other fields are ignored. A blank line ends a block. A UTF-8 byte order
// mark at the start of the stream is ignored (but kept in Raw); a stream of
// only a byte order mark yields one Incomplete block, never an event. When
// the input ends, an unterminated last line is treated as a complete line,
// and a block not yet ended by a blank line is returned with Incomplete set.
//
// A Reader is not safe for concurrent use.
type Reader struct {
	r   io.Reader
	max int

	buf   []byte // buf[:len(buf)] holds unconsumed input
	start int    // start of the current block in buf
	pos   int    // start of the current line
	scan  int    // no line terminator in buf[pos:scan]
	// nextLF is the index of the first '\n' at or after scan, if it is not
	// below scan; otherwise buf[scan:noLF] holds no '\n'.
	nextLF int
	noLF   int

	skipLF  bool // the last line ended in '\r' at the end of the buffer
	started bool // the first line (which may carry a BOM) was seen
	bomHeld bool // the stream's byte order mark is in the current block
	eof     bool
	readErr error // error from r, reported once buffered events are out
	err     error // sticky error returned by Next

	// Current block, with offsets relative to start.
	sawLine  bool // a non-blank line
	sawField bool
	nData    int
	data0    [2]int // span of the first data value
	joined   []byte // data values joined, when nData > 1
	nameSpan [2]int
	hasName  bool
	idSpan   [2]int
	hasID    bool
	retry    time.Duration
	hasRetry bool

	// Strings of the previous event, reused when unchanged.
	lastName, lastID string
}

// NewReader returns a Reader that parses r.
func NewReader(r io.Reader, opts ...ReaderOption) *Reader {
	rd := &Reader{r: r, max: DefaultMaxEventSize, nextLF: -1}
	for _, o := range opts {
		o.applyReader(rd)
	}
	return rd
}

// Ready reports whether the input already read holds the end of another
// block (a blank line after the current position), so that Next can
// return it without waiting for the underlying reader. A writer can
// then hold back its flush: the stream has more to send at once.
func (r *Reader) Ready() bool {
	if r.err != nil || r.pos >= len(r.buf) {
		return false
	}
	b := r.buf[r.pos:]
	// Two line terminators in a row, other than one "\r\n": a blank line.
	return bytes.Contains(b, []byte("\n\n")) || bytes.Contains(b, []byte("\n\r")) || bytes.Contains(b, []byte("\r\r"))
}

// Buffer returns the Reader's input buffer (the one given with WithBuffer,
// or a larger one it grew), emptied, for reuse once neither the Reader nor
// any Event it returned is used again; nil if it has none.
func (r *Reader) Buffer() []byte {
	if r.buf == nil {
		return nil
	}
	return r.buf[:0]
}

// Next returns the next block of the stream. It returns io.EOF once all
// input has been returned, ErrEventTooLarge for an event over the size
// bound, or the error of the underlying reader. Errors are sticky: after
// one, Next keeps returning it. A block that an error other than io.EOF
// interrupts is lost.
//
// The returned Event aliases the Reader's buffers; it is valid only until
// the next call to Next.
func (r *Reader) Next() (Event, error) {
	if r.err != nil {
		return Event{}, r.err
	}
	ev, err := r.next()
	if err != nil {
		r.err = err
	}
	return ev, err
}

func (r *Reader) next() (Event, error) {
	for {
		if r.skipLF && r.pos < len(r.buf) {
			r.skipLF = false
			if r.buf[r.pos] == '\n' {
				r.pos++
				r.scan = r.pos
			}
		}
		eol, termLen := r.findEOL()
		if eol < 0 {
			if r.eof {
				return r.finish()
			}
			if len(r.buf)-r.start > r.max {
				return Event{}, ErrEventTooLarge
			}
			if r.readErr != nil {
				return Event{}, r.readErr
			}
			if err := r.fill(); err != nil {
				return Event{}, err
			}
			continue
		}
		line, lineStart := r.buf[r.pos:eol], r.pos
		r.pos = eol + termLen
		r.scan = r.pos
		if r.line(line, lineStart) && r.sawLine {
			return r.dispatch(false)
		}
		// A blank line before any other line of the block is part of the
		// block's Raw.
	}
}

// findEOL returns the index of the end of the line starting at r.pos and
// the length of its terminator, or -1 if the buffer holds no complete line.
// A '\r' that is the last buffered byte ends the line; a '\n' that may
// follow it in the next read is then skipped (skipLF).
//
// Each byte is searched at most once for '\n' and once for '\r', so long
// lines arriving in small reads and '\r'-only streams stay linear.
func (r *Reader) findEOL() (eol, termLen int) {
	if r.nextLF < r.scan {
		from := max(r.scan, r.noLF)
		if i := bytes.IndexByte(r.buf[from:], '\n'); i >= 0 {
			r.nextLF = from + i
		} else {
			r.noLF = len(r.buf)
		}
	}
	limit := len(r.buf)
	if r.nextLF >= r.scan {
		limit = r.nextLF
	}
	if j := bytes.IndexByte(r.buf[r.scan:limit], '\r'); j >= 0 {
		eol = r.scan + j
		if eol+1 < len(r.buf) {
			if r.buf[eol+1] == '\n' {
				return eol, 2
			}
			return eol, 1
		}
		r.skipLF = !r.eof
		return eol, 1
	}
	if limit < len(r.buf) {
		return limit, 1
	}
	r.scan = len(r.buf)
	return -1, 0
}

// fill reads more input, compacting or growing the buffer as needed.
func (r *Reader) fill() error {
	if r.buf == nil {
		r.buf = make([]byte, 0, initialBufSize)
	}
	if cap(r.buf)-len(r.buf) < minRead {
		if r.start > 0 {
			n := copy(r.buf, r.buf[r.start:])
			r.buf = r.buf[:n]
			r.pos -= r.start
			r.scan -= r.start
			r.nextLF -= r.start
			r.noLF = max(r.noLF-r.start, 0)
			r.start = 0
		}
		if cap(r.buf)-len(r.buf) < minRead {
			nb := make([]byte, len(r.buf), 2*cap(r.buf)+minRead)
			copy(nb, r.buf)
			r.buf = nb
		}
	}
	for range maxEmptyReads {
		n, err := r.r.Read(r.buf[len(r.buf):cap(r.buf)])
		r.buf = r.buf[:len(r.buf)+n]
		if err == io.EOF {
			r.eof = true
			return nil
		}
		if err != nil {
			if n > 0 {
				r.readErr = err // deliver what was read first
				return nil
			}
			return err
		}
		if n > 0 {
			return nil
		}
	}
	return io.ErrNoProgress
}

// line interprets one line that starts at buf[off] and reports whether it
// is blank. Lines are read as classify reads them, the one classification
// of this package (ScrubEvent uses it too): a byte order mark is ignored
// only before the stream's first line; anywhere else it is part of a
// field name.
func (r *Reader) line(line []byte, off int) (blank bool) {
	if !r.started {
		r.started = true
		if bytes.HasPrefix(line, []byte(bom)) {
			line = line[len(bom):]
			off += len(bom)
			r.bomHeld = true
		}
	}
	kind, value := classify(line)
	switch kind {
	case lineBlank:
		return true
	case lineComment:
		r.sawLine = true
		return false
	}
	r.sawLine = true
	r.sawField = true
	valOff := off + len(line) - len(value)
	span := [2]int{valOff - r.start, valOff - r.start + len(value)}
	switch kind {
	case lineData:
		r.nData++
		switch r.nData {
		case 1:
			r.data0 = span
		case 2:
			r.joined = append(r.joined[:0], r.buf[r.start+r.data0[0]:r.start+r.data0[1]]...)
			fallthrough
		default:
			r.joined = append(r.joined, '\n')
			r.joined = append(r.joined, value...)
		}
	case lineEvent:
		r.nameSpan, r.hasName = span, true
	case lineID:
		if bytes.IndexByte(value, 0) < 0 {
			r.idSpan, r.hasID = span, true
		}
	case lineRetry:
		if len(value) > 0 && allDigits(value) {
			if ms, err := strconv.ParseInt(string(value), 10, 64); err == nil && ms <= int64(1<<63-1)/int64(time.Millisecond) {
				r.retry, r.hasRetry = time.Duration(ms)*time.Millisecond, true
			}
		}
	}
	return false
}

func allDigits(b []byte) bool {
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// dispatch returns the block ending at r.pos and resets the block state.
func (r *Reader) dispatch(incomplete bool) (Event, error) {
	if r.pos-r.start > r.max {
		return Event{}, ErrEventTooLarge
	}
	block := r.buf[r.start:r.pos:r.pos]
	ev := Event{
		Raw:        block,
		HasData:    r.nData > 0,
		HasID:      r.hasID,
		HasRetry:   r.hasRetry,
		Retry:      r.retry,
		Comment:    !r.sawField,
		Incomplete: incomplete,
		BOM:        r.bomHeld,
	}
	r.bomHeld = false
	switch {
	case r.nData == 1:
		ev.Data = block[r.data0[0]:r.data0[1]:r.data0[1]]
	case r.nData > 1:
		ev.Data = r.joined
	}
	if r.hasName {
		ev.Name = r.str(&r.lastName, block[r.nameSpan[0]:r.nameSpan[1]])
	}
	if r.hasID {
		ev.ID = r.str(&r.lastID, block[r.idSpan[0]:r.idSpan[1]])
	}
	r.start = r.pos
	r.sawLine, r.sawField, r.nData, r.hasName, r.hasID, r.hasRetry, r.retry = false, false, 0, false, false, false, 0
	return ev, nil
}

// str converts b to a string, reusing *last when it is equal.
func (r *Reader) str(last *string, b []byte) string {
	if string(b) != *last {
		*last = string(b)
	}
	return *last
}

// finish handles the end of input: the unterminated last line, then the
// pending block, then io.EOF.
func (r *Reader) finish() (Event, error) {
	if r.pos < len(r.buf) {
		line, lineStart := r.buf[r.pos:], r.pos
		r.pos = len(r.buf)
		r.scan = r.pos
		r.line(line, lineStart)
	}
	if r.pos == r.start {
		return Event{}, io.EOF
	}
	// Without a non-blank line the rest is only blank lines: a Comment
	// block, complete as it is. A stream that holds nothing but a byte
	// order mark has no line at all: its one block is Incomplete, so that
	// no one mistakes it for an event (its Raw still reproduces the input).
	onlyBOM := r.start == 0 && string(r.buf[:r.pos]) == bom
	return r.dispatch(r.sawLine || onlyBOM)
}
