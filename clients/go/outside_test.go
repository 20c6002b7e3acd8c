package retryd

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestOutsideModuleBuildsOffline (issue 38) follows the README's offline
// route: a module of one's own, outside this repository, vendors the client
// with tools/debian-vendor.sh and builds with no module proxy.
func TestOutsideModuleBuildsOffline(t *testing.T) {
	dir := t.TempDir()
	files := map[string]string{
		"go.mod": "module example.com/outside\n\ngo 1.19\n",
		"main.go": `package main

import (
	"log"
	"net/http"

	retryd "github.com/retryd/retryd/clients/go"
	pb "github.com/retryd/retryd/clients/go/retrydv1"
	"google.golang.org/grpc"
)

func main() {
	client, err := retryd.New("127.0.0.1:50051", retryd.Options{ConnectTimeout: -1})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	_ = &http.Client{Transport: &retryd.Transport{Client: client, Upstream: "catalog"}}
	_ = grpc.WithUnaryInterceptor(client.UnaryClientInterceptor(retryd.InterceptorOptions{}))
	_ = pb.Idempotency_IDEMPOTENCY_SAFE
}
`,
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	run := func(name string, args ...string) {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOFLAGS=-mod=vendor", "GOPROXY=off", "GOTOOLCHAIN=local")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
	}
	here, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	run("bash", filepath.Join(here, "tools", "debian-vendor.sh"), dir)
	// -trimpath: the build cache then serves a later run whatever the
	// temporary directory is called.
	run("go", "build", "-trimpath", "-o", filepath.Join(dir, "outside"), ".")
	if _, err := os.Stat(filepath.Join(dir, "outside")); err != nil {
		t.Fatal(err)
	}
}
