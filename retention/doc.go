// Package retention holds decode handles between turns: [Memory] keeps them
// in process, bounded in entries and value size; the redisstore subpackage
// shares them between router replicas. Both satisfy kvroute.Store and pass
// kvroutetest.TestStore.
package retention
