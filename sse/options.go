package sse

// DefaultMaxEventSize is the default bound on the size of one event's Raw
// bytes.
const DefaultMaxEventSize = 1 << 20

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
