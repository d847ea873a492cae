package redisstore_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// Timeouts of the test deployments, far below production defaults so that a
// failover takes seconds: a node or primary that has not answered for this
// long is failed over.
const (
	clusterNodeTimeout = 1000 * time.Millisecond
	sentinelDownAfter  = 500 * time.Millisecond
	sentinelFailover   = 2000 * time.Millisecond
	deployBudget       = 20 * time.Second // to form a deployment or see a failover
)

// eventually polls cond every 20 ms until it returns nil, failing the test
// with cond's last error after budget.
func eventually(t testing.TB, budget time.Duration, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(budget)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v: %v", what, budget, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// rawClient is a plain client for one server, closed when the test ends.
func rawClient(t testing.TB, addr string) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: 2 * time.Second})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// redisCluster is a Redis Cluster on loopback: three primaries, the first
// with two replicas and the others with one each, so that the first shard
// still has a replica after a failover.
type redisCluster struct {
	nodes    []*server // 0-2 primaries at the start, 3-6 replicas of 0, 0, 1, 2
	bus      []int     // cluster bus ports, as nodes
	ids      []string  // cluster node ids, as nodes
	clients  []*redis.Client
	primary  []int // the nodes that were primaries at the start, per shard
	replicas [][]int
}

// startCluster forms the cluster with CLUSTER ADDSLOTSRANGE, MEET and
// REPLICATE, and waits until every node sees every other, every replica is
// in sync and the cluster state is ok.
func startCluster(t *testing.T) *redisCluster {
	t.Helper()
	needRedis(t)
	c := &redisCluster{primary: []int{0, 1, 2}, replicas: [][]int{{3, 4}, {5}, {6}}}
	ctx := t.Context()
	for range 7 {
		dir := t.TempDir()
		bus := freePort(t)
		srv := launch(t, &server{t: t, dir: dir, extra: []string{
			"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(dir, "nodes.conf"),
			"--cluster-port", strconv.Itoa(bus),
			"--cluster-node-timeout", strconv.Itoa(int(clusterNodeTimeout.Milliseconds())),
			// A replica may take over however long it was cut off: the
			// test kills a primary while its replicas are in sync.
			"--cluster-replica-validity-factor", "0",
			"--repl-diskless-sync-delay", "0", // sync a replica at once
		}})
		c.nodes = append(c.nodes, srv)
		c.bus = append(c.bus, bus)
		cl := rawClient(t, srv.Addr())
		c.clients = append(c.clients, cl)
		id, err := cl.Do(ctx, "cluster", "myid").Text()
		require.NoError(t, err)
		c.ids = append(c.ids, id)
	}
	for i, cl := range c.clients {
		require.NoError(t, cl.Do(ctx, "cluster", "set-config-epoch", i+1).Err())
	}
	const slots = 16384
	for shard, p := range c.primary {
		lo, hi := shard*slots/3, (shard+1)*slots/3-1
		require.NoError(t, c.clients[p].Do(ctx, "cluster", "addslotsrange", lo, hi).Err())
	}
	for _, cl := range c.clients[1:] {
		require.NoError(t, cl.Do(ctx, "cluster", "meet", "127.0.0.1", c.nodes[0].port, c.bus[0]).Err())
	}
	eventually(t, deployBudget, "every node knows every other", func() error {
		for i, cl := range c.clients {
			nodes, err := cl.ClusterNodes(ctx).Result()
			if err != nil {
				return err
			}
			if n := strings.Count(nodes, "\n"); n != len(c.nodes) || strings.Contains(nodes, "handshake") {
				return fmt.Errorf("node %d knows %d nodes: %s", i, n, nodes)
			}
		}
		return nil
	})
	for shard, rs := range c.replicas {
		for _, r := range rs {
			require.NoError(t, c.clients[r].ClusterReplicate(ctx, c.ids[c.primary[shard]]).Err())
		}
	}
	c.waitHealthy(t)
	return c
}

// waitHealthy waits until every live node reports the cluster state ok and
// agrees on the roles, and every live replica is in sync with its primary.
func (c *redisCluster) waitHealthy(t *testing.T) {
	t.Helper()
	ctx := t.Context()
	eventually(t, deployBudget, "cluster healthy", func() error {
		var want string
		for i, cl := range c.clients {
			if c.nodes[i].cmd == nil {
				continue // killed
			}
			info, err := cl.ClusterInfo(ctx).Result()
			if err != nil {
				return err
			}
			if !strings.Contains(info, "cluster_state:ok") {
				return fmt.Errorf("node %d: cluster state not ok", i)
			}
			roles, err := c.roles(ctx, cl)
			if err != nil {
				return err
			}
			if want == "" {
				want = roles
			} else if roles != want {
				return fmt.Errorf("nodes disagree on roles: %s / %s", want, roles)
			}
			repl, err := cl.Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			if strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
				return fmt.Errorf("node %d: replica not in sync", i)
			}
		}
		return nil
	})
}

// roles is a node's view of who is a primary and who replicates whom, in
// a canonical form: "id master" or "id slave master-id" lines, sorted,
// for the nodes it does not consider failed.
func (c *redisCluster) roles(ctx context.Context, cl *redis.Client) (string, error) {
	nodes, err := cl.ClusterNodes(ctx).Result()
	if err != nil {
		return "", err
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(nodes), "\n") {
		f := strings.Fields(l)
		if len(f) < 8 || strings.Contains(f[2], "fail") {
			continue
		}
		role := "master"
		if strings.Contains(f[2], "slave") {
			role = "slave " + f[3]
		}
		lines = append(lines, f[0]+" "+role)
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n"), nil
}

// URL is a redis-cluster:// URL naming every node as a seed.
func (c *redisCluster) URL() string {
	u := "redis-cluster://" + c.nodes[0].Addr()
	for i, n := range c.nodes[1:] {
		sep := "&"
		if i == 0 {
			sep = "?"
		}
		u += sep + "addr=" + n.Addr()
	}
	return u
}

// waitPromoted waits until a live node reports itself the primary of the
// shard that node dead owned, and returns it.
func (c *redisCluster) waitPromoted(t *testing.T, dead int) int {
	t.Helper()
	ctx := t.Context()
	promoted := -1
	eventually(t, deployBudget, "a replica promoted", func() error {
		for i, cl := range c.clients {
			if i == dead || c.nodes[i].cmd == nil {
				continue
			}
			repl, err := cl.Info(ctx, "replication").Result()
			if err != nil {
				continue
			}
			if strings.Contains(repl, "role:master") && c.wasReplicaOf(i, dead) {
				promoted = i
				return nil
			}
		}
		return fmt.Errorf("no replica of node %d is a primary", dead)
	})
	return promoted
}

func (c *redisCluster) wasReplicaOf(r, p int) bool {
	for shard, rs := range c.replicas {
		if c.primary[shard] == p {
			for _, x := range rs {
				if x == r {
					return true
				}
			}
		}
	}
	return false
}

// sentinelSet is a primary with two replicas and three Sentinels (quorum 2)
// on loopback, so that a failover leaves the new primary with a replica.
type sentinelSet struct {
	name      string
	servers   []*server // 0 the primary at the start, 1-2 its replicas
	sentinels []*server
}

// startSentinels starts the servers and the Sentinels and waits until every
// Sentinel knows both replicas and both other Sentinels, which it needs to
// agree that the primary failed and to elect the Sentinel that fails over.
func startSentinels(t *testing.T) *sentinelSet {
	t.Helper()
	needRedis(t)
	s := &sentinelSet{name: "bidikv"}
	sync := []string{"--repl-diskless-sync-delay", "0"} // sync a replica at once
	primary := startServer(t, sync...)
	s.servers = append(s.servers, primary)
	for range 2 {
		s.servers = append(s.servers, startServer(t, append(sync, "--replicaof", "127.0.0.1", strconv.Itoa(primary.port))...))
	}
	ctx := t.Context()
	eventually(t, deployBudget, "replicas in sync", func() error {
		for _, r := range s.servers[1:] {
			repl, err := rawClient(t, r.Addr()).Info(ctx, "replication").Result()
			if err != nil {
				return err
			}
			if !strings.Contains(repl, "master_link_status:up") {
				return fmt.Errorf("replica %s not in sync", r.Addr())
			}
		}
		return nil
	})
	for range 3 {
		dir := t.TempDir()
		conf := filepath.Join(dir, "sentinel.conf") // Sentinel rewrites it
		require.NoError(t, os.WriteFile(conf, fmt.Appendf(nil,
			"sentinel monitor %[1]s 127.0.0.1 %[2]d 2\n"+
				"sentinel down-after-milliseconds %[1]s %[3]d\n"+
				"sentinel failover-timeout %[1]s %[4]d\n",
			s.name, primary.port, sentinelDownAfter.Milliseconds(), sentinelFailover.Milliseconds()), 0o600))
		s.sentinels = append(s.sentinels, launch(t, &server{t: t, dir: dir, pre: []string{conf, "--sentinel"}}))
	}
	eventually(t, deployBudget, "sentinels know the deployment", func() error {
		for _, sn := range s.sentinels {
			sc := redis.NewSentinelClient(&redis.Options{Addr: sn.Addr(), MaxRetries: -1})
			replicas, err := sc.Replicas(ctx, s.name).Result()
			var peers []map[string]string
			if err == nil {
				peers, err = sc.Sentinels(ctx, s.name).Result()
			}
			_ = sc.Close()
			if err != nil {
				return err
			}
			if len(replicas) != 2 || len(peers) != 2 {
				return fmt.Errorf("sentinel %s knows %d replicas and %d sentinels", sn.Addr(), len(replicas), len(peers))
			}
		}
		return nil
	})
	return s
}

// URL is a redis-sentinel:// URL naming every Sentinel.
func (s *sentinelSet) URL() string {
	u := "redis-sentinel://" + s.sentinels[0].Addr() + "/0?master_name=" + s.name
	for _, sn := range s.sentinels[1:] {
		u += "&addr=" + sn.Addr()
	}
	return u
}

// primary returns the index in servers of the primary every Sentinel names.
func (s *sentinelSet) primary(t *testing.T) int {
	t.Helper()
	ctx := t.Context()
	idx := -1
	eventually(t, deployBudget, "sentinels agree on the primary", func() error {
		var addr string
		for _, sn := range s.sentinels {
			sc := redis.NewSentinelClient(&redis.Options{Addr: sn.Addr(), MaxRetries: -1})
			hp, err := sc.GetMasterAddrByName(ctx, s.name).Result()
			_ = sc.Close()
			if err != nil {
				return err
			}
			a := strings.Join(hp, ":")
			if addr != "" && a != addr {
				return fmt.Errorf("sentinels name %s and %s", addr, a)
			}
			addr = a
		}
		for i, srv := range s.servers {
			if srv.Addr() == addr && srv.cmd != nil {
				idx = i
				return nil
			}
		}
		return fmt.Errorf("sentinels name %s, not a live server", addr)
	})
	return idx
}
