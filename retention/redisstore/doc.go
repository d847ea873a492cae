// Package redisstore is a [kvroute.Store] backed by Redis, so that several
// router replicas share the decode handles they retain between turns.
//
// Put is SET key value PX ttl; Take is GETDEL, which Redis runs atomically,
// so among all replicas at most one Take receives a stored handle. On a
// server without GETDEL (Redis < 6.2, or a proxy that does not know it) the
// Store switches by itself to a Lua script that does GET and DEL in one step
// ([WithScriptTake] forces it).
//
// Every call is bounded by a short per-call timeout ([WithTimeout]) on top of
// the caller's context, so that a slow or absent Redis costs a turn at most
// that long: the router treats a failed Take as a miss and a failed Put as a
// handle not retained, and the turn goes on. A Take that times out after
// Redis ran GETDEL loses that handle, which is safe: a handle is used at most
// once, never twice. go-redis reconnects by itself when Redis comes back.
// Failures are counted ([Store.Stats]) and logged through the injected
// logger once per outage: a warning when the first call fails, and one
// record with the number of failed calls and the outage's duration once
// calls have succeeded for [WithRecoveryWindow] without a failure, so that
// a Redis failing only some calls is one outage, not a record per call.
//
// Keys are the router's keys behind a prefix ([DefaultPrefix] unless
// [WithPrefix] says otherwise); values are bounded by [WithMaxValueBytes]
// ([DefaultMaxValueBytes], 8 MiB, enough for the handle of a 1M-token
// context).
//
// The package is its own Go module so that the core module does not depend
// on go-redis.
package redisstore
