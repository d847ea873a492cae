package sim

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
)

// System fingerprint modes (Config.Fingerprint). All but FingerprintAbsent
// are the values of vLLM's --fingerprint-mode.
const (
	// FingerprintAbsent: no system_fingerprint key anywhere, as an engine
	// older than the fingerprint has.
	FingerprintAbsent = "absent"
	// FingerprintFull is vLLM's default:
	// "vllm-<version>[-tp<n>][-dp<n>]-<hash8>".
	FingerprintFull = "full"
	// FingerprintHash is "vllm-<version>-<hash8>".
	FingerprintHash = "hash"
	// FingerprintCustom is Config.FingerprintValue (null when empty).
	FingerprintCustom = "custom"
	// FingerprintNone is null on responses and absent from stream chunks.
	FingerprintNone = "none"
)

// FingerprintVersion is the vLLM version the simulator puts in
// fingerprints.
const FingerprintVersion = "0.0.0+sim"

// SystemFingerprint returns the system_fingerprint the configuration gives,
// and whether the key is written at all: ok is false for FingerprintAbsent;
// a nil fp with ok true is null. Like vLLM's it is fixed at startup: the
// same configuration gives the same fingerprint in every process.
func (c *Config) SystemFingerprint() (fp *string, ok bool) {
	var s string
	switch c.Fingerprint {
	case FingerprintAbsent, "":
		return nil, false
	case FingerprintNone:
		return nil, true
	case FingerprintCustom:
		if c.FingerprintValue == "" {
			return nil, true
		}
		s = c.FingerprintValue
	case FingerprintHash:
		s = "vllm-" + FingerprintVersion + "-" + c.configHash()
	default:
		parts := []string{"vllm-" + FingerprintVersion}
		if c.TPSize > 1 {
			parts = append(parts, fmt.Sprintf("tp%d", c.TPSize))
		}
		if c.dp() > 1 {
			parts = append(parts, fmt.Sprintf("dp%d", c.dp()))
		}
		s = strings.Join(append(parts, c.configHash()), "-")
	}
	return &s, true
}

// configHash stands in for the first 8 hex digits of vLLM's
// vllm_config.compute_hash(): a digest of what shapes the model's outputs
// and the KV layout.
func (c *Config) configHash() string {
	h := sha256.Sum256(fmt.Appendf(nil, "%q|%d|%d|%t|%d|%d|%d|%q|%q|%t|%t|%q|%g",
		c.Model, c.BlockSize, c.NumBlocks, c.PrefixCaching, c.TPSize, c.dp(), max(c.KVGroups, 1),
		c.template(), c.ContentFormat, c.Reasoning, c.InlineReasoning, c.ReasoningField, c.DriftRate))
	return hex.EncodeToString(h[:4])
}

// fingerprintJSON is the system_fingerprint value of a non-streaming
// response: nil (key omitted) for FingerprintAbsent, null or a string.
func (c *Config) fingerprintJSON() json.RawMessage {
	fp, ok := c.SystemFingerprint()
	if !ok {
		return nil
	}
	b, _ := json.Marshal(fp)
	return b
}
