package sim

// KV capacity of the named profiles: how many tokens of KV one engine
// (one vLLM server on one 8×H200 node, tensor parallel 8, as in the
// published P5en runs) can hold, and what a token costs.
//
// vLLM sizes its KV cache on each GPU as
//
//	gpu_memory_utilization × total memory − weights − the profiling peak
//
// (the activations of a max_num_batched_tokens forward pass, CUDA graphs,
// NCCL buffers), and divides it by the KV one token takes on that GPU;
// num_gpu_blocks is that over the block size. Every GPU of a tensor-parallel
// group holds the same positions, so the engine's capacity in tokens is one
// GPU's.
//
//	H200 memory              143,771 MiB (140.4 GiB, as nvidia-smi reports it)
//	gpu_memory_utilization   0.9 (vLLM's long-standing default; main now
//	                         defaults to 0.92, which adds 2.8 GiB of KV a GPU)
//	budget                   126.4 GiB a GPU
//	profiling peak           5 GiB a GPU: an ASSUMPTION (activations at
//	                         max_num_batched_tokens 8192, CUDA graphs, NCCL)
//
// qwen3-32b (Qwen3-32B, BF16, grouped-query attention):
//
//	KV a token   64 layers × 8 KV heads × 128 head dim × 2 (K, V) × 2 bytes
//	             = 262,144 B = 256 KiB; tensor parallel 8 splits the 8 KV
//	             heads, one a GPU: 32 KiB a GPU
//	weights      32.8 B parameters × 2 bytes = 65.6 GB, 7.64 GiB a GPU
//	KV a GPU     126.36 − 7.64 − 5 = 113.72 GiB
//	capacity     113.72 GiB / 32 KiB = 3,726,520 tokens, 232,907 blocks of
//	             16 (910 GiB of KV on the node)
//
// glm-5-fp8 (GLM-5-FP8: DeepSeek-V3.2-style multi-head latent attention
// with a sparse-attention indexer, 78 layers, FP8 weights):
//
//	KV a token   78 layers × (656 + 132) B = 61,464 B (60.0 KiB): vLLM's
//	             fp8_ds_mla layout of the latent (kv_lora_rank 512 in FP8,
//	             4 float32 scales, the 64-dim RoPE key in BF16: 656 B) and
//	             the indexer's key (index_head_dim 128 in FP8 and a float32
//	             scale: 132 B). The latent has no heads to split, so every
//	             GPU of the group holds all of it: 60.0 KiB a GPU, 480 KiB of
//	             the node's memory a token
//	weights      744 B parameters at about 1 byte (FP8 with block scales,
//	             embeddings and norms in BF16): about 750 GB, 87.3 GiB a GPU
//	KV a GPU     126.36 − 87.31 − 5 = 34.05 GiB
//	capacity     34.05 GiB / 61,464 B = 594,829 tokens, 37,176 blocks of 16
//	             (272 GiB of KV on the node)
//
// Profile.KVBytesPerToken is what a token occupies across the engine's
// GPUs (a GPU's bytes × tensor parallel size: 256 KiB and 480 KiB), so that
// tokens held × KVBytesPerToken is the node memory they pin and
// KVCapacityTokens × KVBytesPerToken the node's KV memory.
// TestProfileCapacity checks these figures.

// GPUMemoryUtilization is the gpu_memory_utilization the profiles' capacity
// assumes (vLLM's default before main moved it to 0.92).
const GPUMemoryUtilization = 0.9

// Memory reports a GPU memory budget in bytes.
const (
	h200MemoryBytes = 143771 << 20 // nvidia-smi's 143,771 MiB
	profilingPeak   = 5 << 30      // assumed, per GPU
	gib             = 1 << 30
)

// kvCapacity is the KV capacity in tokens of a tensor-parallel group of tp
// H200s serving a model of weightBytes whose KV takes perGPUBytes a token
// on each GPU.
func kvCapacity(weightBytes float64, tp int, perGPUBytes float64) int {
	budget := GPUMemoryUtilization*h200MemoryBytes - weightBytes/float64(tp) - profilingPeak
	return int(budget / perGPUBytes)
}

// The profiles' KV figures (see above).
var (
	qwen3KVBytes  = int64(64 * 8 * 128 * 2 * 2)
	qwen3Capacity = kvCapacity(32.8e9*2, 8, float64(qwen3KVBytes)/8)
	glm5KVPerGPU  = int64(78 * (656 + 132))
	glm5KVBytes   = glm5KVPerGPU * 8
	glm5Capacity  = kvCapacity(750e9, 8, float64(glm5KVPerGPU))
)

// NumGPUBlocks returns the profile's capacity in usable blocks of bs tokens
// (Config.NumBlocks; 0 when the profile has no capacity).
func (p Profile) NumGPUBlocks(bs int) int {
	if bs <= 0 {
		return 0
	}
	return p.KVCapacityTokens / bs
}
