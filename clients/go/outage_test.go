package retryd

import (
	"context"
	"regexp"
	"strconv"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
)

// Issue 38: one warning when retryd becomes unreachable and one when it is
// back, with counts, whatever the number of fallback decisions and failed
// traffic batches in between.

var answeringAgain = regexp.MustCompile(`answering again after .* unreachable; meanwhile (\d+) decision\(s\)`)

func checkOneWarningPerOutage(t *testing.T, logs *logBuffer, fallbacks int) {
	t.Helper()
	down, back := logs.matching("retryd: unreachable"), logs.matching("answering again")
	if len(down) != 1 || len(back) != 1 {
		t.Fatalf("want one warning each way, got %q", logs.all())
	}
	match := answeringAgain.FindStringSubmatch(back[0])
	if match == nil {
		t.Fatalf("unexpected line back: %q", back[0])
	}
	if n, _ := strconv.Atoi(match[1]); n < fallbacks {
		t.Fatalf("the line back does not count the %d fallback decisions: %q", fallbacks, back[0])
	}
}

// decideUntilAnswered decides until retryd answers (bounded), returning the
// number of fallback decisions made meanwhile.
func decideUntilAnswered(t *testing.T, client *Client) int {
	t.Helper()
	fallbacks := 0
	for deadline := time.Now().Add(hangGuard); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		d, err := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE))
		if err != nil {
			t.Fatal(err)
		}
		if !d.Fallback {
			return fallbacks
		}
		fallbacks++
	}
	t.Fatal("retryd did not answer again within 10s")
	return 0
}

func TestOneWarningPerOutageWhenRetrydIsFrozen(t *testing.T) {
	server := startRetryd(t, clientTestConfig, "")
	logs := &logBuffer{}
	client := newClient(t, server.grpc, Options{Logger: logs.logger(), ReportInterval: 50 * time.Millisecond})
	if d, err := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); err != nil || d.Fallback {
		t.Fatalf("%+v, %v", d, err)
	}
	server.freeze()
	for i := 0; i < 6; i++ {
		client.Reporter().Record("x", 1) // batches fail meanwhile too
		if d, _ := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); !d.Fallback {
			t.Fatal("a decision from a frozen retryd")
		}
	}
	server.thaw()
	decideUntilAnswered(t, client)
	checkOneWarningPerOutage(t, logs, 6)
}

func TestOneWarningPerOutageWhenRetrydIsKilled(t *testing.T) {
	addr := closedAddr(t)
	server := startRetryd(t, clientTestConfig, addr)
	logs := &logBuffer{}
	client := newClient(t, server.grpc, Options{Logger: logs.logger(), ReportInterval: 50 * time.Millisecond})
	if d, err := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); err != nil || d.Fallback {
		t.Fatalf("%+v, %v", d, err)
	}
	server.crash()
	for i := 0; i < 6; i++ {
		client.Reporter().Record("x", 1)
		if d, _ := client.Decide(context.Background(), connectFailure("x", pb.Idempotency_IDEMPOTENCY_SAFE)); !d.Fallback {
			t.Fatal("a decision from a killed retryd")
		}
	}
	server.start(addr)
	decideUntilAnswered(t, client)
	checkOneWarningPerOutage(t, logs, 6)
}
