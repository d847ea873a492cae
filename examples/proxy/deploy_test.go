package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

// The deploy files are checked here, not by building the image or applying
// the manifests: CI has no Docker daemon or cluster. See deploy/README.md.

// k8sDoc is one Kubernetes object of the manifests, with the fields the
// checks read.
type k8sDoc struct {
	APIVersion string `yaml:"apiVersion"`
	Kind       string `yaml:"kind"`
	Metadata   struct {
		Name   string            `yaml:"name"`
		Labels map[string]string `yaml:"labels"`
	} `yaml:"metadata"`
	Spec yaml.Node `yaml:"spec"`
	// Kustomization
	Namespace string   `yaml:"namespace"`
	Resources []string `yaml:"resources"`
}

type selector struct {
	MatchLabels map[string]string `yaml:"matchLabels"`
}

type deploymentSpec struct {
	Replicas int      `yaml:"replicas"`
	Selector selector `yaml:"selector"`
	Template struct {
		Metadata struct {
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"metadata"`
		Spec struct {
			TerminationGracePeriodSeconds int `yaml:"terminationGracePeriodSeconds"`
			SecurityContext               struct {
				RunAsNonRoot *bool `yaml:"runAsNonRoot"`
				RunAsUser    int64 `yaml:"runAsUser"`
				RunAsGroup   int64 `yaml:"runAsGroup"`
			} `yaml:"securityContext"`
			Containers []container `yaml:"containers"`
			Volumes    []struct {
				Name     string    `yaml:"name"`
				EmptyDir yaml.Node `yaml:"emptyDir"`
			} `yaml:"volumes"`
		} `yaml:"spec"`
	} `yaml:"template"`
}

type container struct {
	Name  string   `yaml:"name"`
	Image string   `yaml:"image"`
	Args  []string `yaml:"args"`
	Env   []struct {
		Name      string    `yaml:"name"`
		Value     string    `yaml:"value"`
		ValueFrom yaml.Node `yaml:"valueFrom"`
	} `yaml:"env"`
	Ports []struct {
		Name          string `yaml:"name"`
		ContainerPort int    `yaml:"containerPort"`
	} `yaml:"ports"`
	StartupProbe   *probe `yaml:"startupProbe"`
	LivenessProbe  *probe `yaml:"livenessProbe"`
	ReadinessProbe *probe `yaml:"readinessProbe"`
	Resources      struct {
		Requests map[string]string `yaml:"requests"`
		Limits   map[string]string `yaml:"limits"`
	} `yaml:"resources"`
	SecurityContext struct {
		ReadOnlyRootFilesystem   *bool `yaml:"readOnlyRootFilesystem"`
		RunAsNonRoot             *bool `yaml:"runAsNonRoot"`
		AllowPrivilegeEscalation *bool `yaml:"allowPrivilegeEscalation"`
	} `yaml:"securityContext"`
	VolumeMounts []struct {
		Name      string `yaml:"name"`
		MountPath string `yaml:"mountPath"`
	} `yaml:"volumeMounts"`
}

type probe struct {
	HTTPGet *struct {
		Path string `yaml:"path"`
		Port string `yaml:"port"`
	} `yaml:"httpGet"`
}

type serviceSpec struct {
	ClusterIP string            `yaml:"clusterIP"`
	Selector  map[string]string `yaml:"selector"`
	Ports     []struct {
		Name       string `yaml:"name"`
		Port       int    `yaml:"port"`
		TargetPort string `yaml:"targetPort"`
	} `yaml:"ports"`
}

type pdbSpec struct {
	MinAvailable   *int     `yaml:"minAvailable"`
	MaxUnavailable *int     `yaml:"maxUnavailable"`
	Selector       selector `yaml:"selector"`
}

// readManifests decodes every document of every YAML file in deploy/.
func readManifests(t *testing.T) map[string][]k8sDoc {
	t.Helper()
	files, err := filepath.Glob("deploy/*.yaml")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	out := map[string][]k8sDoc{}
	for _, f := range files {
		fh, err := os.Open(f)
		require.NoError(t, err)
		dec := yaml.NewDecoder(fh)
		for {
			var d k8sDoc
			err := dec.Decode(&d)
			if errors.Is(err, io.EOF) {
				break
			}
			require.NoError(t, err, f)
			out[filepath.Base(f)] = append(out[filepath.Base(f)], d)
		}
		_ = fh.Close()
	}
	return out
}

func decodeSpec(t *testing.T, d k8sDoc, v any) {
	t.Helper()
	require.NoError(t, d.Spec.Decode(v), "%s %s", d.Kind, d.Metadata.Name)
}

// subset reports whether every label of sel is in labels.
func subset(sel, labels map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// dockerfile is what the checks read of the Dockerfile.
type dockerfile struct {
	stages []dockerStage
}

type dockerStage struct {
	from, name string
	lines      []string // instructions after FROM, continuation lines joined
}

func (s dockerStage) instr(name string) []string {
	var out []string
	for _, l := range s.lines {
		if k, rest, _ := strings.Cut(l, " "); strings.EqualFold(k, name) {
			out = append(out, strings.TrimSpace(rest))
		}
	}
	return out
}

func readDockerfile(t *testing.T) dockerfile {
	t.Helper()
	f, err := os.Open("Dockerfile")
	require.NoError(t, err)
	defer f.Close()
	var df dockerfile
	sc := bufio.NewScanner(f)
	var cont string
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		if strings.HasSuffix(l, "\\") {
			cont += strings.TrimSuffix(l, "\\") + " "
			continue
		}
		l, cont = cont+l, ""
		k, rest, _ := strings.Cut(l, " ")
		if strings.EqualFold(k, "FROM") {
			f := strings.Fields(rest)
			st := dockerStage{from: f[0]}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				st.name = f[2]
			}
			df.stages = append(df.stages, st)
			continue
		}
		if len(df.stages) > 0 {
			df.stages[len(df.stages)-1].lines = append(df.stages[len(df.stages)-1].lines, l)
		}
	}
	require.NoError(t, sc.Err())
	require.GreaterOrEqual(t, len(df.stages), 2, "a multi-stage build")
	return df
}

var envRef = regexp.MustCompile(`\$\(([A-Z_][A-Z0-9_]*)\)`)

// TestDockerfile checks the image recipe: a static binary (CGO_ENABLED=0)
// copied into a distroless/static or scratch stage, run by a non-root
// user, the ENTRYPOINT naming the path the binary was copied to, and a CMD
// the proxy accepts.
func TestDockerfile(t *testing.T) {
	df := readDockerfile(t)
	final := df.stages[len(df.stages)-1]
	assert.True(t, strings.HasPrefix(final.from, "gcr.io/distroless/static") || final.from == "scratch", "final stage %q", final.from)

	var build dockerStage
	var built string
	for _, st := range df.stages[:len(df.stages)-1] {
		for _, run := range st.instr("RUN") {
			if strings.Contains(run, "go build") {
				build = st
				assert.Contains(t, run, "CGO_ENABLED=0", "a static binary")
				m := regexp.MustCompile(`-o (\S+)`).FindStringSubmatch(run)
				require.NotNil(t, m, "go build names its output")
				built = m[1]
			}
		}
	}
	require.NotEmpty(t, built, "a stage runs go build")

	// Module files the build copies exist where the context (the
	// repository root) has them, and every module the proxy's go.mod
	// replaces with a local directory has its go.mod copied before the
	// download layer (else go mod download fails on a clean build).
	copied := map[string]bool{}
	for _, c := range build.instr("COPY") {
		f := strings.Fields(c)
		for _, src := range f[:len(f)-1] {
			if src != "." {
				assert.FileExists(t, filepath.Join("..", "..", src), "COPY %s", src)
				copied[src] = true
			}
		}
	}
	gomod, err := os.ReadFile("go.mod")
	require.NoError(t, err)
	replaced := regexp.MustCompile(`=> (\.\./\S*)`).FindAllStringSubmatch(string(gomod), -1)
	require.NotEmpty(t, replaced)
	for _, m := range replaced {
		dir := filepath.ToSlash(filepath.Clean(filepath.Join("examples/proxy", m[1])))
		mod := "go.mod"
		if dir != "." {
			mod = dir + "/go.mod"
		}
		assert.True(t, copied[mod], "the Dockerfile copies %s before go mod download", mod)
	}

	var binary string
	for _, c := range final.instr("COPY") {
		f := strings.Fields(c)
		if len(f) == 3 && f[0] == "--from="+build.name && f[1] == built {
			binary = f[2]
		}
	}
	require.NotEmpty(t, binary, "the final stage copies %s from the build stage", built)

	users := final.instr("USER")
	require.Len(t, users, 1)
	uid, _, _ := strings.Cut(users[0], ":")
	n, err := strconv.Atoi(uid)
	require.NoError(t, err, "USER is numeric, so runAsNonRoot can verify it")
	assert.NotZero(t, n, "not root")

	eps := final.instr("ENTRYPOINT")
	require.Len(t, eps, 1)
	var entry []string
	require.NoError(t, json.Unmarshal([]byte(eps[0]), &entry), "exec form")
	assert.Equal(t, []string{binary}, entry)

	cmds := final.instr("CMD")
	require.Len(t, cmds, 1)
	var cmd []string
	require.NoError(t, json.Unmarshal([]byte(cmds[0]), &cmd))
	c, err := parseConfig(cmd, noEnv, io.Discard)
	require.NoError(t, err, "the CMD is a command line the proxy accepts")
	assert.Equal(t, []string{strconv.Itoa(c.port)}, final.instr("EXPOSE"))
}

// TestDeployManifests checks the Kubernetes manifests against the proxy
// itself: known kinds and API versions, selectors that match, the
// container's arguments parsed by the proxy's own flag set, DNS names that
// point at the headless Services defined next to it, probes and the
// Prometheus scrape annotation on paths the proxy serves at the port it
// listens on, and a security context the Dockerfile's user satisfies.
func TestDeployManifests(t *testing.T) {
	docs := readManifests(t)
	known := map[string]string{"Deployment": "apps/v1", "Service": "v1", "PodDisruptionBudget": "policy/v1",
		"Kustomization": "kustomize.config.k8s.io/v1beta1"}
	byKind := map[string][]k8sDoc{}
	for f, ds := range docs {
		for _, d := range ds {
			want, ok := known[d.Kind]
			if assert.True(t, ok, "%s: unexpected kind %q", f, d.Kind) {
				assert.Equal(t, want, d.APIVersion, "%s: %s", f, d.Kind)
			}
			if d.Kind != "Kustomization" {
				assert.NotEmpty(t, d.Metadata.Name, "%s: a %s without name", f, d.Kind)
			}
			byKind[d.Kind] = append(byKind[d.Kind], d)
		}
	}
	require.Len(t, byKind["Kustomization"], 1)
	kust := byKind["Kustomization"][0]
	var listed []string
	for f := range docs {
		if f != "kustomization.yaml" {
			listed = append(listed, f)
		}
	}
	assert.ElementsMatch(t, listed, kust.Resources, "the kustomization lists every manifest")

	require.Len(t, byKind["Deployment"], 1)
	var dep deploymentSpec
	decodeSpec(t, byKind["Deployment"][0], &dep)
	pod := dep.Template.Spec
	labels := dep.Template.Metadata.Labels
	assert.True(t, subset(dep.Selector.MatchLabels, labels), "the Deployment's selector matches its pods")
	require.Len(t, pod.Containers, 1)
	ctr := pod.Containers[0]
	assert.True(t, strings.HasPrefix(ctr.Image, "bidikv-proxy:") || strings.Contains(ctr.Image, "/bidikv-proxy:"), "the image the README builds")

	// The arguments, with $(VAR) expanded as the kubelet does, are a
	// command line the proxy accepts.
	env := map[string]bool{}
	for _, e := range ctr.Env {
		env[e.Name] = true
		assert.Contains(t, []string{envAPIKeys, "OPENAI_API_KEY", "REDIS_URL"}, e.Name, "an environment variable the proxy or its arguments read")
	}
	args := make([]string, len(ctr.Args))
	for i, a := range ctr.Args {
		args[i] = envRef.ReplaceAllStringFunc(a, func(ref string) string {
			name := envRef.FindStringSubmatch(ref)[1]
			assert.True(t, env[name], "%s refers to %s, which env does not define", a, name)
			return "redis://redis.llm.svc.cluster.local:6379/0"
		})
	}
	cfg, err := parseConfig(args, noEnv, io.Discard)
	require.NoError(t, err, "the container's args are a command line the proxy accepts")
	assert.NotEmpty(t, cfg.redisURL, "replicas share one Redis")
	assert.Greater(t, pod.TerminationGracePeriodSeconds, int(cfg.shutdownGrace.Seconds()), "the kubelet waits for the drain")

	// Ports: the named port is the one the proxy listens on.
	ports := map[string]int{}
	for _, p := range ctr.Ports {
		ports[p.Name] = p.ContainerPort
	}
	require.Contains(t, ports, "http")
	assert.Equal(t, cfg.port, ports["http"], "containerPort http is --port")
	assert.Equal(t, "0.0.0.0", cfg.host, "reachable from the kubelet and the Service")

	// DNS names point at headless Services of engines.yaml, in the
	// kustomization's namespace, by a port name they define.
	services := map[string]serviceSpec{}
	for _, d := range byKind["Service"] {
		var s serviceSpec
		decodeSpec(t, d, &s)
		services[d.Metadata.Name] = s
	}
	srvName := regexp.MustCompile(`^_([a-z0-9-]+)\._tcp\.([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local\.?$`)
	for role, name := range map[string]string{rolePrefill: cfg.dns.prefill, roleDecode: cfg.dns.decode} {
		m := srvName.FindStringSubmatch(name)
		require.NotNil(t, m, "--%s-dns %q is the SRV name of a Service port", role, name)
		svc, ok := services[m[2]]
		require.True(t, ok, "--%s-dns names Service %s, which the manifests define", role, m[2])
		assert.Equal(t, "None", svc.ClusterIP, "%s is headless: its records list the pods", m[2])
		assert.Equal(t, kust.Namespace, m[3], "%s's namespace", m[2])
		assert.True(t, slices.ContainsFunc(svc.Ports, func(p struct {
			Name       string `yaml:"name"`
			Port       int    `yaml:"port"`
			TargetPort string `yaml:"targetPort"`
		}) bool {
			return p.Name == m[1]
		}), "%s has a port named %s", m[2], m[1])
	}

	// The proxy's own Service and PodDisruptionBudget select its pods.
	proxySvc, ok := services[byKind["Deployment"][0].Metadata.Name]
	require.True(t, ok, "a Service for the proxy")
	assert.True(t, subset(proxySvc.Selector, labels))
	for _, p := range proxySvc.Ports {
		assert.Contains(t, ports, p.TargetPort, "the Service targets a named container port")
	}
	require.Len(t, byKind["PodDisruptionBudget"], 1)
	var pdb pdbSpec
	decodeSpec(t, byKind["PodDisruptionBudget"][0], &pdb)
	assert.True(t, subset(pdb.Selector.MatchLabels, labels), "the PodDisruptionBudget selects the proxy's pods")
	require.NotNil(t, pdb.MinAvailable)
	assert.Less(t, *pdb.MinAvailable, dep.Replicas, "a drain can still evict one replica")

	// Security: non-root with the Dockerfile's uid, read-only root, only
	// /tmp writable.
	require.NotNil(t, pod.SecurityContext.RunAsNonRoot)
	assert.True(t, *pod.SecurityContext.RunAsNonRoot)
	df := readDockerfile(t)
	user := df.stages[len(df.stages)-1].instr("USER")
	require.Len(t, user, 1)
	assert.Equal(t, user[0], strconv.FormatInt(pod.SecurityContext.RunAsUser, 10)+":"+strconv.FormatInt(pod.SecurityContext.RunAsGroup, 10), "runAsUser:runAsGroup is the image's USER")
	sc := ctr.SecurityContext
	require.NotNil(t, sc.ReadOnlyRootFilesystem)
	assert.True(t, *sc.ReadOnlyRootFilesystem)
	require.NotNil(t, sc.AllowPrivilegeEscalation)
	assert.False(t, *sc.AllowPrivilegeEscalation)
	for _, vm := range ctr.VolumeMounts {
		assert.Equal(t, "/tmp", vm.MountPath, "the only writable path is a mounted tmp")
		assert.True(t, slices.ContainsFunc(pod.Volumes, func(v struct {
			Name     string    `yaml:"name"`
			EmptyDir yaml.Node `yaml:"emptyDir"`
		}) bool {
			return v.Name == vm.Name && v.EmptyDir.Kind != 0
		}), "%s is an emptyDir", vm.Name)
	}

	// Resources: requests, and a memory limit above what the proxy may
	// buffer.
	assert.NotEmpty(t, ctr.Resources.Requests["cpu"])
	assert.NotEmpty(t, ctr.Resources.Requests["memory"])
	assert.Greater(t, quantity(t, ctr.Resources.Limits["memory"]), cfg.maxBufferedBytes)

	// Probes and the scrape annotation name paths the proxy serves, at
	// the port it listens on: ask a running proxy.
	ann := dep.Template.Metadata.Annotations
	assert.Equal(t, "true", ann["prometheus.io/scrape"])
	assert.Equal(t, strconv.Itoa(cfg.port), ann["prometheus.io/port"])
	p := startInProcess(t, nil)
	check := func(what, path string, want ...int) {
		status, _, body := p.do(t, http.MethodGet, path, "")
		assert.Contains(t, want, status, "%s %s: %s", what, path, body)
	}
	check("metrics", ann["prometheus.io/path"], http.StatusOK)
	for what, pr := range map[string]*probe{"startup": ctr.StartupProbe, "liveness": ctr.LivenessProbe, "readiness": ctr.ReadinessProbe} {
		require.NotNil(t, pr, what)
		require.NotNil(t, pr.HTTPGet, what)
		assert.Contains(t, ports, pr.HTTPGet.Port, "%s probe port", what)
		if what == "readiness" {
			assert.Equal(t, "/ready", pr.HTTPGet.Path)
			check(what, pr.HTTPGet.Path, http.StatusServiceUnavailable) // the test's engines refuse connections
			continue
		}
		assert.Equal(t, "/health", pr.HTTPGet.Path, "%s follows the process, not the engines", what)
		check(what, pr.HTTPGet.Path, http.StatusOK)
	}
	_, _, metrics := p.do(t, http.MethodGet, ann["prometheus.io/path"], "")
	assert.Contains(t, metrics, "bidikv_inflight_turns", "the proxy's own metrics")
}

// quantity parses the Kubernetes memory quantities the manifests use.
func quantity(t *testing.T, q string) int64 {
	t.Helper()
	for suffix, mult := range map[string]int64{"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30} {
		if n, ok := strings.CutSuffix(q, suffix); ok {
			v, err := strconv.ParseInt(n, 10, 64)
			require.NoError(t, err, q)
			return v * mult
		}
	}
	v, err := strconv.ParseInt(q, 10, 64)
	require.NoError(t, err, q)
	return v
}
