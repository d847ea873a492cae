package main

import (
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// deploy/llm-d: the routing sidecar's arguments in the decode patch are a
// command line `bidikv-proxy sidecar` accepts, naming the Redis and the
// headless Services the overlay defines; the kustomization lists every
// manifest; and every metric the picker configuration reads is on the
// sidecar's /metrics.
func TestSidecarDeployLLMD(t *testing.T) {
	read := func(name string, out any) {
		b, err := os.ReadFile(filepath.Join("deploy", "llm-d", name))
		require.NoError(t, err)
		require.NoError(t, yaml.Unmarshal(b, out), name)
	}
	var kust struct {
		Resources []string `yaml:"resources"`
		Patches   []struct {
			Path string `yaml:"path"`
		} `yaml:"patches"`
	}
	read("kustomization.yaml", &kust)
	files, err := filepath.Glob("deploy/llm-d/*.yaml")
	require.NoError(t, err)
	listed := map[string]bool{"kustomization.yaml": true, "epp-config.yaml": true}
	for _, r := range kust.Resources {
		listed[r] = true
	}
	for _, p := range kust.Patches {
		listed[p.Path] = true
	}
	for _, f := range files {
		assert.True(t, listed[filepath.Base(f)], "%s is in the kustomization (or is the picker's configuration)", f)
	}

	var patch struct {
		Spec struct {
			Template struct {
				Spec struct {
					InitContainers []struct {
						Name  string   `yaml:"name"`
						Image string   `yaml:"image"`
						Args  []string `yaml:"args"`
					} `yaml:"initContainers"`
				} `yaml:"spec"`
			} `yaml:"template"`
		} `yaml:"spec"`
	}
	read("patch-decode.yaml", &patch)
	ics := patch.Spec.Template.Spec.InitContainers
	require.Len(t, ics, 1)
	assert.Equal(t, "routing-sidecar", ics[0].Name, "the container name of llm-d's P/D manifests")
	require.NotEmpty(t, ics[0].Args)
	assert.Equal(t, "sidecar", ics[0].Args[0])
	s, err := parseSidecar(ics[0].Args[1:], func(k string) string { return map[string]string{"POD_IP": "10.0.0.5"}[k] }, nil)
	require.NoError(t, err, "the patch's arguments are a command line the sidecar accepts")
	assert.Equal(t, "redis://bidikv-redis:6379/0", s.redisURL)
	assert.Equal(t, []string{"http://10.0.0.5:8200"}, s.localURLs())

	type service struct {
		Kind     string `yaml:"kind"`
		Metadata struct {
			Name string `yaml:"name"`
		} `yaml:"metadata"`
		Spec struct {
			ClusterIP string `yaml:"clusterIP"`
			Ports     []struct {
				Name string `yaml:"name"`
			} `yaml:"ports"`
		} `yaml:"spec"`
	}
	var services []service
	for _, f := range []string{"engines-headless.yaml", "redis.yaml"} {
		fh, err := os.Open(filepath.Join("deploy", "llm-d", f))
		require.NoError(t, err)
		dec := yaml.NewDecoder(fh)
		for {
			var one service
			if dec.Decode(&one) != nil {
				break
			}
			services = append(services, one)
		}
		_ = fh.Close()
	}
	srv := regexp.MustCompile(`^_([a-z0-9-]+)\._tcp\.([a-z0-9-]+)$`)
	for _, name := range []string{s.dns.prefill, s.dns.decode} {
		m := srv.FindStringSubmatch(name)
		require.NotNil(t, m, "%q is the SRV name of a Service port", name)
		found := false
		for _, svc := range services {
			if svc.Kind == "Service" && svc.Metadata.Name == m[2] {
				found = true
				assert.Equal(t, "None", svc.Spec.ClusterIP, "%s is headless", m[2])
				assert.Equal(t, m[1], svc.Spec.Ports[0].Name)
			}
		}
		assert.True(t, found, "%s is defined by the overlay", m[2])
	}

	var epp pickerConfig
	read("epp-config.yaml", &epp)
	cl := kvroutetest.NewCluster(t, 1, 1)
	sc := startSidecar(t, cl.Decode[0].URL())
	status, _, page := sc.do(t, http.MethodGet, "/metrics", "")
	require.Equal(t, http.StatusOK, status)
	keys := map[string]bool{}
	for _, p := range epp.Plugins {
		for _, ec := range p.Parameters.EngineConfigs {
			for _, cm := range ec.CustomMetrics {
				keys[cm.AttributeKey] = true
				assert.Regexp(t, "\n"+regexp.QuoteMeta(cm.MetricSpec)+" ", page, "the sidecar's /metrics has %s", cm.MetricSpec)
			}
		}
	}
	require.NotEmpty(t, keys)
	for _, p := range epp.Plugins {
		if p.Type == "endpoint-attribute-scorer" {
			assert.True(t, keys[p.Parameters.AttributeKey], "%s is extracted", p.Parameters.AttributeKey)
		}
	}
}
