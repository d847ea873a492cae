package capability

import (
	"regexp"
	"strconv"
	"strings"
)

// Version is a vLLM version as GET /version reports it ("0.30.0",
// "0.11.1rc2.dev123+g0a1b2c3", "0.29.0+cu129").
type Version struct {
	Major, Minor, Patch int
	// Pre reports a pre-release or development build ("rc", "dev", "a",
	// "b" after the patch number): it may lack what the release of the
	// same number has.
	Pre bool
}

// ParseVersion reads the leading MAJOR.MINOR[.PATCH] of s (a "v" prefix
// allowed) and whether a pre-release or development suffix follows ("rc1",
// ".dev123"); a local suffix after "+" and a ".postN" are ignored. ok is
// false when s does not start with a version number.
func ParseVersion(s string) (v Version, ok bool) {
	m := versionRE.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return Version{}, false
	}
	v.Major, _ = strconv.Atoi(m[1])
	v.Minor, _ = strconv.Atoi(m[2])
	v.Patch, _ = strconv.Atoi(m[3]) // "" when absent: 0
	rest, _, _ := strings.Cut(m[4], "+")
	rest = strings.TrimPrefix(rest, ".")
	v.Pre = rest != "" && !postRE.MatchString(rest)
	return v, true
}

var (
	versionRE = regexp.MustCompile(`^v?(\d{1,6})\.(\d{1,6})(?:\.(\d{1,6}))?(.*)$`)
	postRE    = regexp.MustCompile(`^post\d*$`)
)

// String writes MAJOR.MINOR.PATCH, with "-pre" for a pre-release.
func (v Version) String() string {
	s := strconv.Itoa(v.Major) + "." + strconv.Itoa(v.Minor) + "." + strconv.Itoa(v.Patch)
	if v.Pre {
		s += "-pre"
	}
	return s
}

// compare orders release numbers, ignoring Pre.
func (v Version) compare(w Version) int {
	for _, d := range []int{v.Major - w.Major, v.Minor - w.Minor, v.Patch - w.Patch} {
		if d != 0 {
			return d
		}
	}
	return 0
}

// Has says whether a build of version v contains a feature first released
// in since: Present at or after it, Absent before it, Unknown for a
// pre-release or development build of since itself (built before or after
// the feature merged).
func (v Version) Has(since Version) State {
	switch c := v.compare(since); {
	case c > 0:
		return Present
	case c < 0:
		return Absent
	case v.Pre:
		return Unknown
	}
	return Present
}

// The first vLLM releases with what a router relies on.
var (
	// SinceReturnTokenIDs: return_token_ids on chat and completions (PR #22587).
	SinceReturnTokenIDs = Version{Major: 0, Minor: 10, Patch: 2}
	// SinceAgentKV: kv_transfer_params on /v1/responses (PR #37424) and
	// /v1/messages (PR #37535), both in the v0.19.0 release notes.
	SinceAgentKV = Version{Major: 0, Minor: 19, Patch: 0}
	// SinceBidirectional: bidirectional_kv_xfer in the NixlConnector (PR
	// #32553, v0.21.0).
	SinceBidirectional = Version{Major: 0, Minor: 21, Patch: 0}
	// SinceScaleOutFlag: `vllm serve` registers the render routes only
	// with --enable-scale-out (PR #55176, v0.30.0; nightlies after PR
	// #54579 used VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1).
	SinceScaleOutFlag = Version{Major: 0, Minor: 30, Patch: 0}
)
