package retention

import "time"

// SetClock makes m read the time from now, for tests of expiry.
func SetClock(m *Memory, now func() time.Time) { m.now = now }
