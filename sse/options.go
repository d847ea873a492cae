package sse

// DefaultMaxEventSize is the default bound on the size of one event's Raw
// bytes: 16 MiB, room for the final chunk of a 1M-token context whose
// kv_transfer_params lists 62,500 block ids in each of two KV groups (about
// 1 MB) plus its token ids. The Reader's buffer grows only as far as the
// events need.
const DefaultMaxEventSize = 16 << 20

// ReaderOption configures a Reader.
type ReaderOption interface {
	applyReader(*Reader)
}

type readerOptionFunc func(*Reader)

func (f readerOptionFunc) applyReader(r *Reader) { f(r) }

// WithMaxEventSize bounds the size of one event's Raw bytes (including the
// blank lines around it). A longer event makes Next fail with
// ErrEventTooLarge. The default is DefaultMaxEventSize; zero or a negative
// n selects the default.
func WithMaxEventSize(n int) ReaderOption {
	return readerOptionFunc(func(r *Reader) {
		if n <= 0 {
			n = DefaultMaxEventSize
		}
		r.max = n
	})
}

// WithBuffer makes the Reader read into buf (from buf[:0]) instead of
// allocating its own buffer; it still grows a larger one when an event
// needs it. With Reader.Buffer, a caller can reuse buffers across streams.
func WithBuffer(buf []byte) ReaderOption {
	return readerOptionFunc(func(r *Reader) {
		if cap(buf) > 0 {
			r.buf = buf[:0]
		}
	})
}
