package sim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
)

// Errors of the side channel.
var (
	ErrUnreachable = errors.New("sim: side channel unreachable")
	ErrEngineID    = errors.New("sim: remote engine id mismatch")
	ErrAddrInUse   = errors.New("sim: side-channel address already registered")
)

// Peer is an engine's side channel as another engine sees it: the handshake
// (engine id and monotonic clock), positional block reads, and the
// notification that frees the emitter's blocks.
type Peer interface {
	// Meta returns the engine's id and its monotonic clock in seconds.
	Meta(ctx context.Context) (engineID string, mono float64, err error)
	// Read returns the data of the given blocks, whatever they hold now.
	// requestID names the handle read, tokens how many positions the reader
	// takes; both are only counted.
	Read(ctx context.Context, engineID, requestID string, blocks []int, tokens int) ([][]uint64, error)
	// Notify tells the emitter that the handle was consumed; it frees the
	// blocks held for requestID (a notification for blocks unknown or
	// already freed changes nothing).
	Notify(ctx context.Context, engineID, requestID string) error
	// Heartbeat renews the lease of the blocks a prefiller holds for
	// requestID while its decoder waits for room to read them, as the
	// connector's heartbeats do.
	Heartbeat(ctx context.Context, engineID, requestID string) error
}

// Registry resolves side-channel addresses to peers: engines in this process
// register themselves; other addresses go to Dial when it is set.
type Registry struct {
	mu    sync.Mutex
	peers map[string]Peer
	n     int
	// Dial reaches an address no engine registered (nil: unreachable).
	Dial func(host string, port int) Peer
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{peers: map[string]Peer{}} }

func addrKey(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }

// Register binds host:port to p.
func (r *Registry) Register(host string, port int, p Peer) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := addrKey(host, port)
	if _, ok := r.peers[k]; ok {
		return fmt.Errorf("%w: %s", ErrAddrInUse, k)
	}
	r.peers[k] = p
	return nil
}

// Unregister removes host:port if it is bound to p.
func (r *Registry) Unregister(host string, port int, p Peer) {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := addrKey(host, port)
	if r.peers[k] == p {
		delete(r.peers, k)
	}
}

// Lookup returns the peer at host:port, or nil.
func (r *Registry) Lookup(host string, port int) Peer {
	r.mu.Lock()
	p, ok := r.peers[addrKey(host, port)]
	dial := r.Dial
	r.mu.Unlock()
	if ok {
		return p
	}
	if dial != nil {
		return dial(host, port)
	}
	return nil
}

// NextAddr returns a fresh synthetic side-channel address such as
// 10.0.0.3:5600. Nothing dials it in-process.
func (r *Registry) NextAddr() (string, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n++
	return fmt.Sprintf("10.0.%d.%d", r.n/250, r.n%250+1), 5600
}
