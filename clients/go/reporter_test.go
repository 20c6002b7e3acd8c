package retryd

import (
	"context"
	"testing"
	"time"

	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

func TestReportedTrafficFillsAnEmptyBudget(t *testing.T) {
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	ctx := context.Background()
	before, err := client.GetBudget(ctx, "go-empty")
	if err != nil {
		t.Fatal(err)
	}
	reporter := NewTrafficReporter(client, ReporterOptions{})
	reporter.Record("go-empty", 10) // ratio 0.5: 5 tokens
	if err := reporter.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	after, err := client.GetBudget(ctx, "go-empty")
	if err != nil {
		t.Fatal(err)
	}
	if got := after.GetTokens() - before.GetTokens(); got < 4.99 || got > 5.01 {
		t.Fatalf("tokens %v -> %v", before.GetTokens(), after.GetTokens())
	}
	if len(reporter.Pending()) != 0 {
		t.Fatalf("pending %v", reporter.Pending())
	}
}

func TestReporterResendsABatchWithTheSameID(t *testing.T) {
	fake := &fakeDecider{report: func(n int, req *pb.ReportTrafficRequest) (*pb.ReportTrafficResponse, error) {
		if n == 1 {
			return nil, status.Error(codes.Unavailable, "try later")
		}
		return &pb.ReportTrafficResponse{Accepted: uint32(len(req.GetTraffic()))}, nil
	}}
	client := newClient(t, startFake(t, fake), Options{})
	reporter := NewTrafficReporter(client, ReporterOptions{Logger: client.logger})
	reporter.Record("a", 2)
	reporter.Record("b", 3)
	if err := reporter.Flush(context.Background()); status.Code(err) != codes.Unavailable {
		t.Fatalf("first flush: %v", err)
	}
	reporter.Record("a", 5) // recorded while the batch is unsent: the next batch
	if got := reporter.Pending(); got["a"] != 7 || got["b"] != 3 {
		t.Fatalf("pending %v", got)
	}
	if err := reporter.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	reports := fake.reports()
	if len(reports) != 3 {
		t.Fatalf("%d reports", len(reports))
	}
	if reports[0].GetReportId() == "" || !proto.Equal(reports[0], reports[1]) {
		t.Fatalf("the re-send differs: %v then %v", reports[0], reports[1])
	}
	if reports[2].GetReportId() == reports[0].GetReportId() || len(reports[2].GetTraffic()) != 1 ||
		reports[2].GetTraffic()[0].GetRequests() != 5 {
		t.Fatalf("the next batch: %v", reports[2])
	}
	if len(reporter.Pending()) != 0 || reporter.Dropped() != 0 {
		t.Fatalf("pending %v, dropped %d", reporter.Pending(), reporter.Dropped())
	}
}

func TestReporterDropsABatchRefusedForGood(t *testing.T) {
	for _, code := range []codes.Code{codes.PermissionDenied, codes.ResourceExhausted, codes.InvalidArgument} {
		fake := &fakeDecider{report: func(n int, req *pb.ReportTrafficRequest) (*pb.ReportTrafficResponse, error) {
			return nil, status.Error(code, "no")
		}}
		var logs logBuffer
		client := newClient(t, startFake(t, fake), Options{Logger: logs.logger()})
		reporter := NewTrafficReporter(client, ReporterOptions{Logger: logs.logger()})
		reporter.Record("a", 2)
		reporter.Record("b", 3)
		if err := reporter.Flush(context.Background()); err != nil {
			t.Fatalf("%s: %v", code, err)
		}
		if err := reporter.Flush(context.Background()); err != nil {
			t.Fatalf("%s: %v", code, err)
		}
		if n := len(fake.reports()); n != 1 {
			t.Fatalf("%s: sent %d times", code, n)
		}
		if reporter.Dropped() != 5 || len(reporter.Pending()) != 0 || len(logs.matching("dropping")) != 1 {
			t.Fatalf("%s: dropped %d, pending %v, logs %q", code, reporter.Dropped(), reporter.Pending(), logs.all())
		}
	}
}

func TestReporterSplitsBatchesOf1024AndStopsOnClose(t *testing.T) {
	fake := &fakeDecider{}
	client := newClient(t, startFake(t, fake), Options{})
	reporter := NewTrafficReporter(client, ReporterOptions{Interval: 20 * time.Millisecond})
	reporter.Start()
	for i := 0; i < 1500; i++ {
		reporter.Record("u"+string(rune('a'+i%26))+string(rune('a'+i/26%26))+string(rune('a'+i/676)), 1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := reporter.Close(ctx); err != nil {
		t.Fatal(err)
	}
	var entries, requests int
	for _, report := range fake.reports() {
		if len(report.GetTraffic()) > MaxTrafficEntries {
			t.Fatalf("a batch of %d entries", len(report.GetTraffic()))
		}
		entries += len(report.GetTraffic())
		for _, e := range report.GetTraffic() {
			requests += int(e.GetRequests())
		}
	}
	if requests != 1500 {
		t.Fatalf("%d requests in %d entries reported", requests, entries)
	}
	// Nothing sends after Close: its goroutine has ended (a state, checked
	// at once, instead of sleeping five intervals to see nothing arrive),
	// and what is recorded afterwards stays pending.
	select {
	case <-reporter.done:
	default:
		t.Fatal("the reporter's goroutine still runs after Close")
	}
	sent := len(fake.reports())
	reporter.Record("late", 1)
	if len(fake.reports()) != sent || reporter.Pending()["late"] != 1 {
		t.Fatalf("the reporter still sends after Close: %d reports, pending %v", len(fake.reports()), reporter.Pending())
	}
}

func TestReporterBoundsUpstreamsWhileRetrydIsAway(t *testing.T) {
	client := newClient(t, closedAddr(t), Options{})
	reporter := NewTrafficReporter(client, ReporterOptions{MaxUpstreams: 2, Logger: client.logger})
	reporter.Record("a", 1)
	reporter.Record("b", 1)
	reporter.Record("c", 4)
	reporter.Record("a", 1)
	if err := reporter.Flush(context.Background()); err == nil {
		t.Fatal("a flush to nowhere succeeded")
	}
	if got := reporter.Pending(); got["a"] != 2 || got["b"] != 1 || len(got) != 2 || reporter.Dropped() != 4 {
		t.Fatalf("pending %v, dropped %d", got, reporter.Dropped())
	}
}

// A batch re-sent with its report_id, as the reporter re-sends after a
// timeout, is applied once by the real server: the second call answers
// already_applied and the budget does not move.
func TestAResentReportIsAppliedOnceByRetryd(t *testing.T) {
	client := newClient(t, shared(t).grpc, Options{NoFallback: true})
	ctx := context.Background()
	tokens := func() float64 {
		budget, err := client.GetBudget(ctx, "go-dedup")
		if err != nil {
			t.Fatal(err)
		}
		return budget.GetTokens()
	}
	request := &pb.ReportTrafficRequest{
		Traffic:  []*pb.UpstreamTraffic{{Upstream: "go-dedup", Requests: 4}},
		ReportId: "go-resent-" + time.Now().Format("150405.000000000"),
	}
	before := tokens()
	first, err := client.ReportTraffic(ctx, request)
	if err != nil || first.GetAccepted() != 1 || first.GetAlreadyApplied() != 0 {
		t.Fatalf("first send: %v, %v", first, err)
	}
	applied := tokens()
	if applied <= before {
		t.Fatalf("the report deposited nothing: %v -> %v", before, applied)
	}
	again, err := client.ReportTraffic(ctx, request)
	if err != nil || again.GetAccepted() != 0 || again.GetAlreadyApplied() != 1 {
		t.Fatalf("re-send: %v, %v", again, err)
	}
	if after := tokens(); after != applied {
		t.Fatalf("the re-send deposited again: %v -> %v", applied, after)
	}
}
