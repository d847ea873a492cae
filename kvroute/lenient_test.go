package kvroute

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The cases follow pydantic-core's str_as_bool, int_as_bool, str_as_int
// (clean_int_str) and float_as_int.
func TestLenientBool(t *testing.T) {
	accepted := []struct {
		in   string
		want bool
	}{
		{`true`, true}, {`false`, false},
		{`1`, true}, {`0`, false}, {`-0`, false},
		{`1.0`, true}, {`0.0`, false}, {`1e0`, true}, {`100e-2`, true}, {`0E5`, false},
		{`"true"`, true}, {`"True"`, true}, {`"TRUE"`, true}, {`"false"`, false}, {`"FaLsE"`, false},
		{`"1"`, true}, {`"0"`, false},
		{`"yes"`, true}, {`"no"`, false}, {`"YES"`, true}, {`"No"`, false},
		{`"on"`, true}, {`"off"`, false}, {`"ON"`, true}, {`"Off"`, false},
		{`"t"`, true}, {`"f"`, false}, {`"T"`, true}, {`"F"`, false},
		{`"y"`, true}, {`"n"`, false}, {`"Y"`, true}, {`"N"`, false},
		{`"\u0074rue"`, true},
	}
	for _, tc := range accepted {
		t.Run("accept/"+tc.in, func(t *testing.T) {
			got, ok := lenientBool([]byte(tc.in))
			require.True(t, ok)
			assert.Equal(t, tc.want, got)
		})
	}
	rejected := []string{
		`2`, `-1`, `0.5`, `1.5`, `2.0`, `1e30`, `99999999999999999999`,
		`"2"`, `"1.0"`, `" true"`, `"true "`, `""`, `"maybe"`, `"yeah"`, `"nope"`,
		`"yeſ"`, // U+017F folds to 's' in Unicode, not in ASCII
		`null`, `[]`, `{}`, `[true]`, ``,
	}
	for _, in := range rejected {
		t.Run("reject/"+in, func(t *testing.T) {
			_, ok := lenientBool([]byte(in))
			assert.False(t, ok)
		})
	}
}

func TestLenientInt(t *testing.T) {
	accepted := []struct {
		in   string
		want int64
	}{
		{`5`, 5}, {`-5`, -5}, {`0`, 0},
		{`5.0`, 5}, {`5e0`, 5}, {`1e2`, 100}, {`-3.000`, -3},
		{`true`, 1}, {`false`, 0},
		{`"5"`, 5}, {`" 5 "`, 5}, {`"\t5\n"`, 5}, {`"+5"`, 5}, {`"-5"`, -5},
		{`"007"`, 7}, {`"5.0"`, 5}, {`"5.00"`, 5}, {`"0.0"`, 0}, {`"-0"`, 0},
		{`"1_000"`, 1000}, {`"1_000.0"`, 1000},
	}
	for _, tc := range accepted {
		t.Run("accept/"+tc.in, func(t *testing.T) {
			got, ok := lenientInt([]byte(tc.in))
			require.True(t, ok)
			assert.Equal(t, tc.want, got)
		})
	}
	rejected := []string{
		`5.5`, `1e30`, `-1e30`, `99999999999999999999`,
		`"5.5"`, `"5."`, `".0"`, `"5e0"`, `"0x10"`, `""`, `" "`, `"abc"`, `"five"`,
		`"1__0"`, `"_1"`, `"1_"`, `"+-1"`, `"-+1"`, `"--1"`, `"++1"`, `"+ 1"`, `"5.0_0"`,
		`"99999999999999999999"`,
		`null`, `[]`, `{}`, `[1]`, ``,
	}
	for _, in := range rejected {
		t.Run("reject/"+in, func(t *testing.T) {
			_, ok := lenientInt([]byte(in))
			assert.False(t, ok)
		})
	}
}

// TestRequestStream checks that parse accepts the stream values vLLM
// accepts, rejects the others with a 400, and that Streaming agrees.
func TestRequestStream(t *testing.T) {
	cases := []struct {
		stream string // "" leaves the member out
		ok     bool
		want   bool
	}{
		{"", true, false},
		{`null`, true, false},
		{`true`, true, true},
		{`false`, true, false},
		{`1`, true, true},
		{`0`, true, false},
		{`1.0`, true, true},
		{`"true"`, true, true},
		{`"True"`, true, true},
		{`"1"`, true, true},
		{`"yes"`, true, true},
		{`"on"`, true, true},
		{`"off"`, true, false},
		{`"n"`, true, false},
		{`2`, false, false},
		{`"maybe"`, false, false},
		{`" true"`, false, false},
		{`[]`, false, false},
		{`{}`, false, false},
	}
	for _, tc := range cases {
		t.Run(tc.stream, func(t *testing.T) {
			body := `{"messages":[{"role":"user","content":"x"}]`
			if tc.stream != "" {
				body += `,"stream":` + tc.stream
			}
			r := &Request{Path: PathChatCompletions, Body: []byte(body + "}")}
			err := r.parse(Defaults().Limits.ObjectMembers)
			if !tc.ok {
				require.ErrorIs(t, err, ErrBadRequest)
				assert.Contains(t, err.Error(), "stream must be a boolean")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, r.streaming())
		})
	}
}
