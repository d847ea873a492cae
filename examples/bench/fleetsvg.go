package main

import "io"

func writeFleetSVG(w io.Writer, rep fleetReport) error { return nil }
