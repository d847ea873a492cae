package kvhandle

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRelease(t *testing.T) {
	d := `{"do_remote_prefill":false,"do_remote_decode":true,"remote_block_ids":[[11,12,13,14,15,16,17]],"remote_engine_id":"d","remote_request_id":"r","remote_host":"10.0.0.2","remote_port":5601,"tp_size":1,"remote_num_tokens":100,"remote_blocks_expiry_time":12345.50,"x":{"k":[1.50]}}`
	out, err := Release([]byte(d), 16)
	require.NoError(t, err)
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(out, &m))
	assert.Equal(t, "0", string(m["remote_num_tokens"]))
	assert.Equal(t, "true", string(m["do_remote_decode"]))
	assert.Equal(t, "false", string(m["do_remote_prefill"]))
	assert.Equal(t, "[[11,12,13,14,15,16,17]]", string(m["remote_block_ids"]), "the blocks stay: the engine ignores a handle without them")
	assert.Equal(t, "12345.50", string(m["remote_blocks_expiry_time"]), "numbers as written")
	assert.Equal(t, `{"k":[1.50]}`, string(m["x"]), "unknown members verbatim")
	hi, err := Check(out, 16)
	require.NoError(t, err)
	assert.Zero(t, hi.Tokens)

	// Role flags of a stored P-like handle are forced; a handle without
	// remote_num_tokens gets one.
	out, err = Release([]byte(strings.NewReplacer(`"do_remote_prefill":false`, `"do_remote_prefill":true`, `,"remote_num_tokens":100`, ``).Replace(d)), 16)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(out, &m))
	assert.Equal(t, "false", string(m["do_remote_prefill"]))
	assert.Equal(t, "0", string(m["remote_num_tokens"]))

	for _, bad := range []string{
		`{"remote_block_ids":[],"remote_engine_id":"p","remote_request_id":"q","remote_host":"h","remote_port":1}`,
		`{"remote_block_ids":[[1]],"remote_request_id":"q","remote_host":"h","remote_port":1}`,
		`{"remote_block_ids":[[1]],"remote_engine_id":"p","remote_request_id":"q","remote_host":"h","remote_port":1,"remote_port":2}`,
		`[]`,
	} {
		_, err := Release([]byte(bad), 16)
		assert.Error(t, err, bad)
	}
}

// FuzzRelease checks Release against an oracle that decodes what goes
// out: a handle Check accepts becomes one Check accepts with 0 tokens,
// the role flags forced, remote_num_tokens 0 and every other member
// exactly as it came (Python's json would read the same values); a
// handle Check refuses is refused.
func FuzzRelease(f *testing.F) {
	valid := `{"do_remote_prefill":false,"do_remote_decode":true,"remote_block_ids":[[11,12,13,14,15,16,17]],"remote_engine_id":"d","remote_request_id":"r","remote_host":"10.0.0.2","remote_port":5601,"tp_size":1,"remote_num_tokens":100,"remote_blocks_expiry_time":12345.5}`
	for _, s := range []string{
		valid,
		strings.Replace(valid, `"remote_num_tokens":100`, `"remote_num_tokens":null`, 1),
		strings.Replace(valid, `,"remote_num_tokens":100`, ``, 1),
		strings.Replace(valid, `"do_remote_decode":true`, `"do_remote_decode":false`, 1),
		`{"remote_block_ids":[1,2],"remote_engine_id":"p","remote_request_id":"q","remote_host":"h","remote_port":1,"z":[{"a":1e5}]}`,
		`{ "remote_block_ids" : [ [ 1 ] ] , "remote_engine_id" : "p" , "remote_request_id" : "q" , "remote_host" : "h" , "remote_port" : 1 }`,
		`{"remote_block_ids":[[]],"remote_engine_id":null,"remote_request_id":"q","remote_host":"h","remote_port":1}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		_, checkErr := Check(raw, 16)
		out, err := Release(raw, 16)
		if checkErr != nil {
			if err == nil {
				t.Fatalf("Release accepted %s, which Check refuses (%v)", raw, checkErr)
			}
			return
		}
		if err != nil {
			t.Fatalf("Release refused %s: %v", raw, err)
		}
		hi, err := Check(out, 16)
		if err != nil || hi.Tokens != 0 || hi.PushMode != pushMode(raw) {
			t.Fatalf("Release(%s) = %s: Check %+v %v", raw, out, hi, err)
		}
		in, got := members(t, raw), members(t, out)
		want := map[string]string{"do_remote_decode": "true", "do_remote_prefill": "false", "remote_num_tokens": "0"}
		for k, v := range in {
			if _, forced := want[k]; !forced {
				want[k] = v
			}
		}
		if len(got) != len(want) {
			t.Fatalf("Release(%s) = %s: members %v, want %v", raw, out, got, want)
		}
		for k, v := range want {
			if got[k] != v {
				t.Fatalf("Release(%s) = %s: %s is %s, want %s", raw, out, k, got[k], v)
			}
		}
	})
}

// members decodes a JSON object into its members' compacted values.
func members(t *testing.T, raw []byte) map[string]string {
	t.Helper()
	var m map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&m); err != nil {
		t.Fatalf("%s: %v", raw, err)
	}
	out := map[string]string{}
	for k, v := range m {
		var b bytes.Buffer
		if err := json.Compact(&b, v); err != nil {
			t.Fatalf("%s: %v", raw, err)
		}
		out[k] = b.String()
	}
	return out
}

func pushMode(raw []byte) bool {
	hi, _ := Check(raw, 16)
	return hi.PushMode
}
