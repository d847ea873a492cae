// Package retention holds decode handles between turns. [Memory] keeps them
// in process, bounded in entries and in value size; it is kvroute's default
// Store. The redisstore module, under this directory, shares handles between
// router replicas. Stores are checked with kvroutetest.TestStore.
package retention
