// Package discovery finds engine endpoints in DNS and keeps a Router's
// endpoints current with them, for engines that come and go, as the pods
// behind a Kubernetes headless Service do.
//
// A DNS source (NewDNS) resolves one name: "host:port" through A and AAAA
// records (a headless Service's name lists its ready pods' addresses; the
// port is given, since those records carry none), or "_service._proto.name"
// through SRV records, which carry ports. Each address becomes one
// transport.Endpoint, or, with WithDPSize(n), n endpoints pinned to the
// data-parallel ranks 0..n-1 of the engine behind it. It uses the standard
// library's resolver, or any Resolver.
//
// A Watcher re-resolves a Source on an interval and hands each changed set
// to a function, typically kvroute.Router.SetEndpoints:
//
//   - An engine that disappears from DNS stops receiving new turns after the
//     next refresh; turns already running on it finish (the Router keeps
//     the endpoint a turn picked).
//   - A retained handle of a decode engine that is no longer listed is not
//     attached (kvroute.MissEndpointGone): the prefill engine could not pull
//     its blocks. It is left in the store to expire rather than deleted: the
//     store has no index by engine, and another router sharing it may still
//     list the engine (its own refresh comes later), or the engine may return
//     under the same address.
//   - An answer that says the name has no records (NXDOMAIN, or no record of
//     the type asked, as a Service scaled to zero gives) empties the pool:
//     turns fail fast with 503 until engines return, rather than being sent
//     to addresses that are gone. Any other resolution failure (a timeout,
//     SERVFAIL, an unreachable server) keeps the last good set. Both are
//     counted (WatchStats) and logged once per run of failures.
//
// The package starts no goroutine: Watcher.Run blocks until its context
// ends, on the caller's goroutine.
package discovery
