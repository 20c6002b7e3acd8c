package retryd_test

import (
	"context"
	"net/http"
)

func httpNewRequest(ctx context.Context, url string) (*http.Request, error) {
	return http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
}
