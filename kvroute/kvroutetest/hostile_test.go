package kvroutetest_test

import (
	"net/http"
	"testing"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Every hostile answer is an attack the oracle sees: forwarded as the
// engine sent it, CheckLeak finds the handle; and its clean form, when it
// has one, passes.
func TestHostileAnswersAreCaught(t *testing.T) {
	for _, path := range []string{kvroutetest.PathChat, kvroutetest.PathCompletions, kvroutetest.PathResponses, kvroutetest.PathMessages} {
		for _, stream := range []bool{false, true} {
			answers := kvroutetest.HostileAnswers(path, stream)
			if len(answers) < 40 {
				t.Errorf("%s stream=%v: only %d answers", path, stream, len(answers))
			}
			ct := "application/json"
			if stream {
				ct = "text/event-stream"
			}
			for _, a := range answers {
				if err := kvroutetest.CheckLeak(a.Header, a.Body, kvroutetest.HostileSecrets()...); err == nil {
					t.Errorf("%s stream=%v %q: forwarded as is, the oracle sees no leak", path, stream, a.Name)
				}
				if a.Clean != nil {
					if err := kvroutetest.CheckLeak(http.Header{"Content-Type": {ct}}, a.Clean, kvroutetest.HostileSecrets()...); err != nil {
						t.Errorf("%s stream=%v %q: the clean answer fails the oracle: %v", path, stream, a.Name, err)
					}
				}
			}
		}
	}
}
