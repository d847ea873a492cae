// Package redisstore is a [kvroute.Store] backed by Redis, so that several
// router replicas share the decode handles they retain between turns.
//
// Put is SET key value PX ttl; Take is GETDEL, which Redis runs atomically,
// so among all router replicas at most one Take receives a stored handle
// (see Deployments for what a failover changes). On a server without GETDEL
// (Redis < 6.2, or a proxy that does not know it) the Store switches by
// itself to a Lua script that does GET and DEL in one step
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
// # Deployments
//
// [NewFromURL] reads one URL per deployment: redis:// (or rediss://) for one
// Redis, redis-sentinel:// for a primary with replicas under Sentinel
// (master_name and the Sentinels' addresses), redis-cluster:// for a Redis
// Cluster (seed nodes); [New] takes any go-redis [redis.UniversalClient]
// built by the caller. Several router replicas share handles by using the
// same deployment and prefix. Every command names one key, so in a cluster
// it runs on the primary that owns the key's slot and needs no hash tags.
// A Sentinel client follows the primary Sentinel names after a failover;
// a cluster client is made to reload the slot map on every failed call, so
// that it finds the promoted replica as soon as the cluster has one. Calls
// during a failover fail like calls to a Redis that is down: a miss or a
// handle not retained, counted and logged once per outage.
//
// Replication is asynchronous: a primary that dies after a GETDEL and
// before its replicas saw it can be replaced by a replica that still holds
// the value, which a later Take hands out again. [WithWaitReplicas] makes
// Take return a value only once replicas have acknowledged the delete.
//
// Keys are the router's keys behind a prefix ([DefaultPrefix] unless
// [WithPrefix] says otherwise); values are bounded by [WithMaxValueBytes]
// ([DefaultMaxValueBytes], 8 MiB, enough for the handle of a 1M-token
// context).
//
// The package is its own Go module so that the core module does not depend
// on go-redis.
package redisstore
