package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"strings"
	"time"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/otelobserver"
)

// The OpenTelemetry environment variables the proxy reads itself (the
// exporter and the SDK read the others: OTEL_EXPORTER_OTLP_HEADERS,
// _TIMEOUT, _COMPRESSION, _CERTIFICATE, OTEL_TRACES_SAMPLER, OTEL_BSP_*,
// OTEL_RESOURCE_ATTRIBUTES).
const (
	envOTLPEndpoint       = "OTEL_EXPORTER_OTLP_ENDPOINT"
	envOTLPTracesEndpoint = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	envTracesExporter     = "OTEL_TRACES_EXPORTER"
	envServiceName        = "OTEL_SERVICE_NAME"
	envSDKDisabled        = "OTEL_SDK_DISABLED"
)

// defaultServiceName is service.name when OTEL_SERVICE_NAME is unset.
const defaultServiceName = "bidikv-proxy"

// telemetryShutdown bounds the flush of the spans still buffered at exit.
const telemetryShutdown = 5 * time.Second

// telemetry is the proxy's tracing: off (nil) unless the environment asks
// for it.
type telemetry struct {
	tp  *sdktrace.TracerProvider
	obs *otelobserver.Observer
}

// newTelemetry sets up tracing from the environment, with the standard
// OpenTelemetry variables: spans go over OTLP/HTTP when
// OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is
// set, or to stdout as JSON with OTEL_TRACES_EXPORTER=console;
// OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true turn tracing off. It
// returns nil when tracing is off.
func newTelemetry(getenv func(string) string, stdout io.Writer, log *slog.Logger) (*telemetry, error) {
	if strings.EqualFold(getenv(envSDKDisabled), "true") {
		return nil, nil
	}
	var exp sdktrace.SpanExporter
	var where string
	switch kind := strings.TrimSpace(getenv(envTracesExporter)); kind {
	case "none":
		return nil, nil
	case "console":
		e, err := stdouttrace.New(stdouttrace.WithWriter(stdout))
		if err != nil {
			return nil, err
		}
		exp, where = e, "stdout"
	case "", "otlp":
		endpoint := otlpTracesURL(getenv)
		if endpoint == "" && kind == "" {
			return nil, nil // nothing asks for traces
		}
		var opts []otlptracehttp.Option
		if endpoint != "" {
			opts = append(opts, otlptracehttp.WithEndpointURL(endpoint))
		}
		e, err := otlptracehttp.New(context.Background(), opts...)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %v", errUsage, envOTLPEndpoint, err)
		}
		exp, where = e, "the exporter's default endpoint"
		if u, err := url.Parse(endpoint); err == nil && endpoint != "" {
			where = u.Redacted() // never a password in the log
		}
	default:
		return nil, fmt.Errorf("%w: %s=%q: use otlp, console or none", errUsage, envTracesExporter, kind)
	}
	name := getenv(envServiceName)
	if name == "" {
		name = defaultServiceName
	}
	res, err := resource.Merge(resource.Default(), resource.NewWithAttributes(semconv.SchemaURL, semconv.ServiceName(name)))
	if err != nil {
		return nil, err
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	obs, err := otelobserver.New(otelobserver.WithTracerProvider(tp))
	if err != nil {
		_ = tp.Shutdown(context.Background())
		return nil, err
	}
	log.Info("tracing", slog.String("exporter", where), slog.String("service_name", name))
	return &telemetry{tp: tp, obs: obs}, nil
}

// otlpTracesURL is the traces endpoint of the OTLP/HTTP exporter:
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as given, or
// OTEL_EXPORTER_OTLP_ENDPOINT with /v1/traces appended; "" when neither is
// set.
func otlpTracesURL(getenv func(string) string) string {
	if u := strings.TrimSpace(getenv(envOTLPTracesEndpoint)); u != "" {
		return u
	}
	if u := strings.TrimSpace(getenv(envOTLPEndpoint)); u != "" {
		return strings.TrimRight(u, "/") + "/v1/traces"
	}
	return ""
}

// options returns the router options that trace turns (none when tracing
// is off).
func (t *telemetry) options() []kvroute.Option {
	if t == nil {
		return nil
	}
	return []kvroute.Option{kvroute.WithTracer(t.obs)}
}

// shutdown flushes the spans still buffered and stops the exporter; it
// runs after the drain, when every turn has ended.
func (t *telemetry) shutdown(log *slog.Logger) {
	if t == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), telemetryShutdown)
	defer cancel()
	if err := t.tp.Shutdown(ctx); err != nil {
		log.Warn("tracing: flushing spans at exit failed", slog.String("err", err.Error()))
	}
}
