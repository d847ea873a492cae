package main

import (
	"fmt"
	"slices"
)

// kvRoles are vLLM's kv_role values (vllm/config/kv_transfer.py, KVRole).
// NixlConnector acts on each request's kv_transfer_params, not on the
// role, and neither does the simulator; docs/engines.md says which role
// each engine takes.
var kvRoles = []string{"kv_producer", "kv_consumer", "kv_both"}

// checkRole refuses what vLLM's KVTransferConfig.__post_init__ refuses: a
// kv_role that is not one of vLLM's, and a kv_connector without one.
func (k kvTransferConfig) checkRole() error {
	switch {
	case k.KVRole != "" && !slices.Contains(kvRoles, k.KVRole):
		return fmt.Errorf("unsupported kv_role %q: vLLM's roles are %v", k.KVRole, kvRoles)
	case k.KVConnector != "" && k.KVRole == "":
		return fmt.Errorf("kv_connector %q without a kv_role: vLLM requires one of %v", k.KVConnector, kvRoles)
	}
	return nil
}
