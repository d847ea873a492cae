//go:build !bidikv_bufcheck

package bufpool

// Checked reports whether this build checks the pools' ownership rules
// (build tag bidikv_bufcheck, which make test sets): see checker.
const Checked = false
