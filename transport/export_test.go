package transport

// Test hooks: a virtual clock for the deadline timers of a Client.

type (
	Clock = clock
	Timer = timer
)

// SetClock makes c start its deadline timers on clk.
func SetClock(c *Client, clk Clock) { c.clock = clk }
