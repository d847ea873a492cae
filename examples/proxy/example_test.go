package main

import (
	"fmt"
	"io"
)

// The reference proxy's command line, with several values after one flag
// name as argparse's nargs="+" reads them, becomes the engines' base URLs.
func Example_referenceCommandLine() {
	cfg, err := parseConfig([]string{
		"--host", "0.0.0.0", "--port", "9000",
		"--prefiller-hosts", "10.0.0.1", "10.0.0.2", "--prefiller-ports", "8100", "8101",
		"--decoder-host", "fd00::7", "--decoder-port", "8200",
	}, func(string) string { return "" }, io.Discard)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(cfg.host, cfg.port)
	fmt.Println(cfg.prefillURLs)
	fmt.Println(cfg.decodeURLs)
	// Output:
	// 0.0.0.0 9000
	// [http://10.0.0.1:8100 http://10.0.0.2:8101]
	// [http://[fd00::7]:8200]
}
