package main

import (
	"fmt"
	"slices"
	"strings"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/capability"
)

// The --decode-stream modes: streams pass through as the decode engine
// sends them (the default), or streams without a handle are buffered
// (kvroute's DecodeMemory.BufferStreams).
const (
	decodeStreamEngine   = "engine"
	decodeStreamBuffered = "buffered"
)

// bufferable names the APIs --decode-stream buffered:API,... takes, and
// their paths. Responses streams carry the handle on response.completed:
// never buffered.
var bufferable = []struct {
	name, path string
	api        capability.API
}{
	{"chat", kvroute.PathChatCompletions, capability.Chat},
	{"completions", kvroute.PathCompletions, capability.Completions},
	{"messages", kvroute.PathMessages, capability.Messages},
}

// decodeStream is --decode-stream: the paths whose streams are buffered
// (nil: none).
type decodeStream struct{ paths *[]string }

func (d decodeStream) String() string {
	if d.paths == nil || len(*d.paths) == 0 {
		return decodeStreamEngine
	}
	if len(*d.paths) == len(bufferable) {
		return decodeStreamBuffered
	}
	var names []string
	for _, b := range bufferable {
		if slices.Contains(*d.paths, b.path) {
			names = append(names, b.name)
		}
	}
	return decodeStreamBuffered + ":" + strings.Join(names, ",")
}

// Set parses engine, buffered, or buffered:API[,API...].
func (d decodeStream) Set(s string) error {
	mode, apis, per := strings.Cut(s, ":")
	switch {
	case s == decodeStreamEngine:
		*d.paths = nil
		return nil
	case mode != decodeStreamBuffered:
		return fmt.Errorf("%q: use %s, %s, or %s:API[,API] with API chat, completions or messages", s, decodeStreamEngine, decodeStreamBuffered, decodeStreamBuffered)
	case !per:
		*d.paths = nil
		for _, b := range bufferable {
			*d.paths = append(*d.paths, b.path)
		}
		return nil
	}
	var paths []string
	for _, name := range strings.Split(apis, ",") {
		i := slices.IndexFunc(bufferable, func(b struct {
			name, path string
			api        capability.API
		}) bool {
			return b.name == strings.TrimSpace(name)
		})
		switch {
		case strings.TrimSpace(name) == "responses":
			return fmt.Errorf("%q: Responses streams carry the handle on response.completed and are never buffered", s)
		case i < 0:
			return fmt.Errorf("%q: %q is not an API with buffered streams: use chat, completions or messages", s, name)
		case !slices.Contains(paths, bufferable[i].path):
			paths = append(paths, bufferable[i].path)
		}
	}
	*d.paths = paths
	return nil
}

// buffers reports whether streamed turns of the API a are buffered.
func (c *config) buffers(a capability.API) bool {
	for _, b := range bufferable {
		if b.api == a {
			return slices.Contains(c.bufferStreams, b.path)
		}
	}
	return false
}
