module github.com/bidikv/bidikv

go 1.26.0

require (
	github.com/cenkalti/backoff/v4 v4.3.0
	github.com/jellydator/ttlcache/v3 v3.4.1
	github.com/stretchr/testify v1.12.1
	github.com/tmaxmax/go-sse v0.12.0
	go.uber.org/goleak v1.3.0
	golang.org/x/sync v0.25.0
)

require go.yaml.in/yaml/v3 v3.0.5 // indirect
