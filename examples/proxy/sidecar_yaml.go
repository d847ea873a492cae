package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"go.yaml.in/yaml/v3"
)

// sidecarYAML is llm-d's sidecar configuration (--configuration,
// --configuration-file): its keys, as its yamlConfiguration spells them.
type sidecarYAML struct {
	Port                    int      `yaml:"port"`
	ModelServerPort         int      `yaml:"model-server-port"`
	VLLMPort                int      `yaml:"vllm-port"`
	MooncakeBootstrapPort   int      `yaml:"mooncake-bootstrap-port"`
	P2PConnectorPort        int      `yaml:"p2p-connector-port"`
	DataParallelSize        int      `yaml:"data-parallel-size"`
	KVConnector             string   `yaml:"kv-connector"`
	ECConnector             string   `yaml:"ec-connector"`
	EnableSSRFProtection    *bool    `yaml:"enable-ssrf-protection"`
	EnablePrefillerSampling *bool    `yaml:"enable-prefiller-sampling"`
	EnableP2PPull           *bool    `yaml:"enable-p2p-pull"`
	SecureServing           *bool    `yaml:"secure-proxy"`
	CertPath                string   `yaml:"cert-path"`
	EnableTLS               []string `yaml:"enable-tls"`
	TLSInsecureSkipVerify   []string `yaml:"tls-insecure-skip-verify"`
	InferencePool           string   `yaml:"inference-pool"`
	PoolGroup               string   `yaml:"pool-group"`
	MaxIdleConnsPerHost     int      `yaml:"max-idle-conns-per-host"`
	PrefillMaxRetries       *int     `yaml:"prefill-max-retries"`
	PrefillRetryBackoff     string   `yaml:"prefill-retry-backoff"`
	DecodeChunkSize         int      `yaml:"decode-chunk-size"`
	Tracing                 *bool    `yaml:"tracing"`
	MetricsPort             int      `yaml:"metrics-port"`
}

// configuration merges --configuration or --configuration-file into the
// flags not given on the command line, as llm-d does: unknown keys are an
// error; a zero number or an empty string in the YAML sets nothing.
func (s *sidecarConfig) configuration() error {
	var data []byte
	switch {
	case s.inline != "" && s.file != "":
		return fmt.Errorf("%w: --configuration and --configuration-file are mutually exclusive", errUsage)
	case s.inline != "":
		data = []byte(s.inline)
	case s.file != "":
		b, err := os.ReadFile(s.file)
		if err != nil {
			return fmt.Errorf("%w: --configuration-file: %v", errUsage, err)
		}
		data = b
	default:
		return nil
	}
	var y sidecarYAML
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&y); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: the sidecar configuration: %v", errUsage, err)
	}
	num := func(name string, v int, dst *int) {
		if v != 0 && !s.set[name] {
			*dst = v
			s.set[name+"@yaml"] = true
		}
	}
	str := func(name, v string, dst *string) {
		if v != "" && !s.set[name] {
			*dst = v
		}
	}
	boolean := func(name string, v *bool, dst *bool) {
		if v != nil && !s.set[name] {
			*dst = *v
		}
	}
	list := func(name string, v []string, dst *[]string) {
		if len(v) > 0 && !s.set[name] {
			*dst = v
		}
	}
	num("port", y.Port, &s.port)
	num("model-server-port", y.ModelServerPort, &s.modelServerPort)
	num("vllm-port", y.VLLMPort, &s.vllmPort)
	num("mooncake-bootstrap-port", y.MooncakeBootstrapPort, &s.mooncakePort)
	num("p2p-connector-port", y.P2PConnectorPort, &s.p2pPort)
	num("data-parallel-size", y.DataParallelSize, &s.dpSize)
	num("max-idle-conns-per-host", y.MaxIdleConnsPerHost, &s.maxIdlePerHost)
	num("decode-chunk-size", y.DecodeChunkSize, &s.decodeChunk)
	num("metrics-port", y.MetricsPort, &s.metricsPort)
	str("kv-connector", y.KVConnector, &s.kvConnector)
	str("ec-connector", y.ECConnector, &s.ecConnector)
	str("cert-path", y.CertPath, &s.certPath)
	str("inference-pool", y.InferencePool, &s.inferencePool)
	str("pool-group", y.PoolGroup, &s.poolGroup)
	boolean("enable-ssrf-protection", y.EnableSSRFProtection, &s.ssrf)
	boolean("enable-prefiller-sampling", y.EnablePrefillerSampling, &s.samplePrefill)
	boolean("enable-p2p-pull", y.EnableP2PPull, &s.p2pPull)
	boolean("secure-proxy", y.SecureServing, &s.secure)
	boolean("tracing", y.Tracing, &s.tracing)
	list("enable-tls", y.EnableTLS, &s.enableTLS)
	list("tls-insecure-skip-verify", y.TLSInsecureSkipVerify, &s.skipVerify)
	if y.PrefillMaxRetries != nil && !s.set["prefill-max-retries"] {
		s.prefillRetries = *y.PrefillMaxRetries
	}
	if y.PrefillRetryBackoff != "" && !s.set["prefill-retry-backoff"] {
		d, err := time.ParseDuration(y.PrefillRetryBackoff)
		if err != nil {
			// llm-d warns and keeps its default.
			s.warnings = append(s.warnings, fmt.Sprintf("the sidecar configuration's prefill-retry-backoff %q is not a duration (%v): using %v", y.PrefillRetryBackoff, err, s.prefillBackoff))
		} else {
			s.prefillBackoff = d
		}
	}
	return nil
}
