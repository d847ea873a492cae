// Package retention holds decode handles between turns. [Memory] keeps them
// in process, bounded in entries ([DefaultMaxEntries]), in bytes
// ([DefaultMaxBytes], 1 GiB) and in value size ([DefaultMaxValueSize],
// 8 MiB, enough for a handle of a 1M-token context with two KV groups); it
// is kvroute's default Store. [Memory.Stats] reports what it holds and what
// it evicted. The redisstore module, under this directory, shares handles
// between router replicas. Stores are checked with kvroutetest.TestStore.
package retention
