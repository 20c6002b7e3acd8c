package retryd

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// hangGuard is how long a test waits for a state it expects before failing:
// a guard against a hang, never a latency claim (the Rust testkit's
// HANG_GUARD). A bound that is the client's promise is named as such where
// it is asserted.
const hangGuard = 30 * time.Second

// clientTestConfig has fast backoffs, so that end-to-end retry tests sleep
// milliseconds.
const clientTestConfig = `
[server]
listen = "%s"
metrics_listen = "127.0.0.1:0"

[defaults]
max_attempts = 3
min_attempt_budget = "20ms"
max_retry_after = "60s"
transient_500 = false
budget = { capacity = 1000.0, initial = 1000.0, ratio = 0.1, min_per_second = 1.0 }
backoff = { base = "10ms", max = "50ms", jitter = "full" }

# A large minimum attempt budget, so deadline tests need no tight timing.
[upstreams."go-slow"]
min_attempt_budget = "300ms"

# An empty budget that only reported traffic fills.
[upstreams."go-empty"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }
# Issue 36: an empty budget that reported traffic cannot fill (0.1 token
# per request), so the first retry is DENY BUDGET_EXHAUSTED.
[upstreams."go-nobudget"]
budget = { capacity = 10.0, initial = 0.0, ratio = 0.1, min_per_second = 0.0 }
[upstreams."go-dedup"]
budget = { capacity = 1000000.0, initial = 0.0, ratio = 0.5, min_per_second = 0.0 }
`

// retrydServer is a real retryd started from $RETRYD_BIN for one test (or
// one package run).
type retrydServer struct {
	t      testing.TB
	bin    string // "" means retrydBin
	config string
	dir    string
	grpc   string
	// metrics is the address of its Prometheus endpoint (GET /metrics).
	metrics string
	cmd     *exec.Cmd
	done    chan struct{}
}

func retrydBin(t testing.TB) string {
	bin := os.Getenv("RETRYD_BIN")
	if bin == "" {
		bin = filepath.Join("..", "..", "target", "debug", "retryd")
	}
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("no retryd binary at %s (cargo build --bin retryd, or set RETRYD_BIN): %v", bin, err)
	}
	return bin
}

// startRetryd starts retryd with config (its listen address a %s, filled
// with listen, "127.0.0.1:0" when empty) and stops it when the test ends.
func startRetryd(t testing.TB, config, listen string) *retrydServer {
	t.Helper()
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	s := &retrydServer{t: t, config: config, dir: t.TempDir()}
	s.start(listen)
	t.Cleanup(s.stop)
	return s
}

func (s *retrydServer) start(listen string) {
	s.t.Helper()
	path := filepath.Join(s.dir, "retryd.toml")
	text := s.config
	if strings.Contains(text, "%s") {
		text = fmt.Sprintf(text, listen)
	}
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		s.t.Fatal(err)
	}
	stderr, err := os.Create(filepath.Join(s.dir, "retryd.stderr"))
	if err != nil {
		s.t.Fatal(err)
	}
	bin := s.bin
	if bin == "" {
		bin = retrydBin(s.t)
	}
	cmd := exec.Command(bin, "serve", "--config", path)
	cmd.Stderr = stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		s.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("starting retryd: %v", err)
	}
	s.cmd, s.done = cmd, make(chan struct{})
	lines := make(chan string, 1)
	go func() {
		reader := bufio.NewReader(stdout)
		line, _ := reader.ReadString('\n')
		lines <- line
		_, _ = io.Copy(io.Discard, reader) // keep draining
	}()
	go func() {
		_ = cmd.Wait()
		stderr.Close()
		close(s.done)
	}()
	select {
	case line := <-lines:
		var addresses struct{ GRPC, Metrics string }
		if err := json.Unmarshal([]byte(line), &addresses); err != nil || addresses.GRPC == "" {
			s.kill()
			log, _ := os.ReadFile(filepath.Join(s.dir, "retryd.stderr"))
			s.t.Fatalf("retryd did not start (%q: %v); stderr:\n%s", line, err, log)
		}
		s.grpc, s.metrics = addresses.GRPC, addresses.Metrics
	case <-time.After(60 * time.Second):
		s.kill()
		s.t.Fatal("retryd did not print its addresses within 60s")
	}
}

func (s *retrydServer) kill() {
	_ = s.cmd.Process.Kill()
	<-s.done
}

// stop ends retryd with SIGTERM (SIGKILL after 10s), and is a no-op if it
// already ended. A frozen (SIGSTOPped) server is thawed first.
func (s *retrydServer) stop() {
	select {
	case <-s.done:
		return
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGCONT)
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(10 * time.Second):
		s.kill()
	}
}

// crash ends retryd with SIGKILL, as a crash would (a SIGTERM waits for
// open streams to end).
func (s *retrydServer) crash() { s.kill() }

// freeze stops retryd with SIGSTOP and waits until the kernel reports it
// stopped (the signal is delivered asynchronously: a request sent at once
// could still be answered).
func (s *retrydServer) freeze() {
	_ = s.cmd.Process.Signal(syscall.SIGSTOP)
	stat := fmt.Sprintf("/proc/%d/stat", s.cmd.Process.Pid)
	for deadline := time.Now().Add(hangGuard); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		data, err := os.ReadFile(stat)
		// The state follows the parenthesized command name: "pid (comm) T ...".
		if i := strings.LastIndexByte(string(data), ')'); err == nil && i >= 0 && i+2 < len(data) && data[i+2] == 'T' {
			return
		}
	}
	s.t.Fatalf("retryd did not stop after SIGSTOP")
}

func (s *retrydServer) thaw() { _ = s.cmd.Process.Signal(syscall.SIGCONT) }

// closedAddr is a loopback address nothing listens on: a port that was just
// bound and released, so connecting is refused at once.
func closedAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// logBuffer collects a client's log lines for assertions.
type logBuffer struct {
	mu    sync.Mutex
	lines []string
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.lines = append(b.lines, strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func (b *logBuffer) matching(substring string) []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for _, line := range b.lines {
		if strings.Contains(line, substring) {
			out = append(out, line)
		}
	}
	return out
}

// all is a copy of every line so far, read under the lock: the client's
// goroutines may still be writing when a test reports what it saw.
func (b *logBuffer) all() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.lines...)
}

func (b *logBuffer) logger() *log.Logger { return log.New(b, "", 0) }

// newClient connects to addr with opts and closes the client when the test
// ends.
func newClient(t testing.TB, addr string, opts Options) *Client {
	t.Helper()
	if opts.Logger == nil {
		opts.Logger = log.New(io.Discard, "", 0)
	}
	client, err := New(addr, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	return client
}

// sharedRetryd is one retryd with clientTestConfig for the tests that do
// not stop or freeze it.
var (
	sharedOnce   sync.Once
	sharedServer *retrydServer
	sharedT      = &packageTB{}
)

// packageTB lets a server outlive one test: its Cleanup runs in TestMain.
type packageTB struct {
	testing.TB
	mu       sync.Mutex
	cleanups []func()
	dir      string
}

func (p *packageTB) Helper()                           {}
func (p *packageTB) Cleanup(f func())                  { p.mu.Lock(); p.cleanups = append(p.cleanups, f); p.mu.Unlock() }
func (p *packageTB) Fatal(args ...interface{})         { panic(fmt.Sprint(args...)) }
func (p *packageTB) Fatalf(f string, a ...interface{}) { panic(fmt.Sprintf(f, a...)) }
func (p *packageTB) TempDir() string {
	if p.dir == "" {
		dir, err := os.MkdirTemp("", "retryd-go-test")
		if err != nil {
			panic(err)
		}
		p.dir = dir
	}
	return p.dir
}

func (p *packageTB) close() {
	for i := len(p.cleanups) - 1; i >= 0; i-- {
		p.cleanups[i]()
	}
	if p.dir != "" {
		os.RemoveAll(p.dir)
	}
}

func shared(t testing.TB) *retrydServer {
	t.Helper()
	retrydBin(t) // fail the test, not the package, if there is no binary
	sharedOnce.Do(func() { sharedServer = startRetryd(sharedT, clientTestConfig, "") })
	if sharedServer == nil {
		t.Fatal("the shared retryd did not start")
	}
	return sharedServer
}

func TestMain(m *testing.M) {
	code := m.Run()
	sharedT.close()
	os.Exit(code)
}

// fakeClock records the waits asked of it and returns at once (or with
// ctx's error if ctx is already done): a test asserts the backoffs exactly,
// with no sleep and no ceiling on wall time.
type fakeClock struct {
	mu    sync.Mutex
	waits []time.Duration
}

func (c *fakeClock) wait(ctx context.Context, d time.Duration) error {
	c.mu.Lock()
	c.waits = append(c.waits, d)
	c.mu.Unlock()
	return ctx.Err()
}

func (c *fakeClock) asked() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]time.Duration(nil), c.waits...)
}

// withFakeClock puts a fakeClock into client.
func withFakeClock(client *Client) *fakeClock {
	fake := &fakeClock{}
	client.clock = fake
	return fake
}
