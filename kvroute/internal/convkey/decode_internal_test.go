package convkey

import (
	"encoding/json"
	"runtime"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// escapeAll spells s as a JSON string with every rune escaped (\uXXXX,
// surrogate pairs above the BMP): the longest spelling of s.
func escapeAll(s string) []byte {
	b, _ := json.Marshal(s) // the reference spelling, for invalid UTF-8's U+FFFD
	var dec string
	_ = json.Unmarshal(b, &dec)
	out := []byte{'"'}
	for _, r := range dec {
		if r > 0xffff {
			r -= 0x10000
			out = appendU4(appendU4(out, 0xd800+(r>>10)), 0xdc00+(r&0x3ff))
			continue
		}
		out = appendU4(out, r)
	}
	return append(out, '"')
}

func appendU4(b []byte, r rune) []byte {
	const hexdig = "0123456789abcdef"
	return append(b, '\\', 'u', hexdig[r>>12&0xf], hexdig[r>>8&0xf], hexdig[r>>4&0xf], hexdig[r&0xf])
}

// stringSum is the digest of the JSON string q hashed as a content field.
func stringSum(q []byte) [32]byte {
	d := New()
	d.content("content", 't', q, true)
	return d.Sum()
}

// textSum is the digest of the text s hashed as a content field.
func textSum(s string) [32]byte {
	d := New()
	d.content("content", 't', []byte(s), false)
	return d.Sum()
}

// checkDecoded checks that the JSON string q hashes as its decoding by
// encoding/json.
func checkDecoded(t *testing.T, q []byte) {
	t.Helper()
	var s string
	require.NoError(t, json.Unmarshal(q, &s), "%q", q)
	assert.Equal(t, textSum(s), stringSum(q), "%q", q)
}

// The hasher hashes a JSON string as its decoding, whatever its escapes
// and however long the runs between them (hashed in chunks of hashChunk).
func TestTaggedStringIsTheDecoding(t *testing.T) {
	long := strings.Repeat("0123456789abcdef", 3*hashChunk/16)
	for _, s := range []string{
		"", "plain", `quote " and backslash \ and slash /`, "tab\tnewline\ncr\r", "\x00\x1f\x7f",
		"café", "日本語", "😀 astral", "<html>&amp;", "\u2028\u2029",
		long,                             // one run longer than a chunk
		strings.Repeat("a\n", hashChunk), // short runs filling many chunks
		"é" + long + "\n" + long[:hashChunk/2+1] + "\t" + long[:hashChunk/2-1] + "\"", // runs around a chunk's half
		"bad \xff UTF-8 \xc3", // invalid bytes decode to U+FFFD
	} {
		t.Run(strings.ToValidUTF8(s[:min(len(s), 24)], "?"), func(t *testing.T) {
			std, err := json.Marshal(s)
			require.NoError(t, err)
			checkDecoded(t, std)
			checkDecoded(t, escapeAll(s))
			if utf8.ValidString(s) && !strings.ContainsAny(s, "\"\\\x00\x01\x1f\n\r\t") {
				checkDecoded(t, []byte(`"`+s+`"`)) // raw, no escape
			}
		})
	}
	// Raw invalid UTF-8 (valid JSON; encoding/json reads U+FFFD for it).
	checkDecoded(t, []byte("\"a\xffb\""))
	checkDecoded(t, []byte("\"a\\n\xffb\""))
	// An unpaired surrogate escape decodes to U+FFFD.
	checkDecoded(t, []byte(`"\ud83d x"`))
	checkDecoded(t, []byte(`"\ude00"`))
}

// bytesPerRun is the memory fn allocates per call, averaged over runs.
func bytesPerRun(runs int, fn func()) uint64 {
	fn()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range runs {
		fn()
	}
	runtime.ReadMemStats(&after)
	return (after.TotalAlloc - before.TotalAlloc) / uint64(runs)
}

// Hashing a string with escapes never builds its decoding: what it
// allocates does not grow with the text (a few bytes of decoding state for
// each string, none for the text).
func TestTaggedStringDoesNotBuildTheText(t *testing.T) {
	short := escapeAll("héllo wörld\n")
	long := escapeAll(strings.Repeat("héllo wörld\n", 4*hashChunk))
	d := New()
	hash := func(q []byte) func() {
		return func() {
			d.Reset()
			d.content("content", 't', q, true)
			_ = d.Sum()
		}
	}
	assert.Equal(t, testing.AllocsPerRun(20, hash(short)), testing.AllocsPerRun(20, hash(long)), "allocations per string, not per byte")
	assert.Less(t, bytesPerRun(20, hash(long)), uint64(len(long)/100), "%d bytes of text", len(long))

	c := NewChainer()
	message := func(q []byte) func() {
		m := []byte(`{"role":"user","content":` + string(q) + `}`)
		return func() { _, _, _ = c.Message([32]byte{}, m, nil) }
	}
	assert.Equal(t, testing.AllocsPerRun(20, message(short)), testing.AllocsPerRun(20, message(long)), "a message with escaped content")
	assert.Less(t, bytesPerRun(20, message(long)), uint64(len(long)/100), "a message with escaped content")
}

// FuzzTaggedString: any JSON string hashes as encoding/json's decoding of
// it, spelled as given or with every rune escaped.
func FuzzTaggedString(f *testing.F) {
	for _, s := range []string{`""`, `"a"`, `"\u00e9\n"`, `"\ud83d\ude00"`, `"\ud83d"`, "\"\xff\"", `"\/\b\f"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, q []byte) {
		if len(q) < 2 || q[0] != '"' || q[len(q)-1] != '"' || !json.Valid(q) {
			return // not one string token, as a parsed message holds
		}
		var s string
		if err := json.Unmarshal(q, &s); err != nil {
			t.Fatalf("%q: %v", q, err)
		}
		want := textSum(s)
		if got := stringSum(q); got != want {
			t.Fatalf("%q hashes otherwise than its decoding %q", q, s)
		}
		if got := stringSum(escapeAll(s)); got != want {
			t.Fatalf("%q escaped in full hashes otherwise than %q", q, s)
		}
	})
}
