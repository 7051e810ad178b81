package shoal

import (
	"context"

	"connectrpc.com/connect"

	pb "github.com/shoal-sandbox/shoal/api/shoal/v1"
)

// CreateKey makes an API key for tenant with scopes ("sandboxes",
// "layers:read", "layers:write", "admin") and returns it with its secret,
// which the server shows only this once. Needs an admin key.
func (c *Client) CreateKey(ctx context.Context, name, tenant string, scopes ...string) (*pb.Key, string, error) {
	res, err := c.Admin.CreateKey(ctx, connect.NewRequest(&pb.CreateKeyRequest{Name: name, Tenant: tenant, Scopes: scopes}))
	if err != nil {
		return nil, "", err
	}
	return res.Msg.Key, res.Msg.Secret, nil
}

// DeleteKey removes the key named name. Needs an admin key.
func (c *Client) DeleteKey(ctx context.Context, name string) error {
	_, err := c.Admin.DeleteKey(ctx, connect.NewRequest(&pb.DeleteKeyRequest{Name: name}))
	return err
}

// SetQuota sets a tenant's whole quota (a zero field: no bound). Needs an
// admin key.
func (c *Client) SetQuota(ctx context.Context, tenant string, q *pb.Quota) (*pb.Tenant, error) {
	res, err := c.Admin.SetTenant(ctx, connect.NewRequest(&pb.SetTenantRequest{Name: tenant, Quota: q}))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// WhoAmI describes the client's key: its name, tenant and scopes.
func (c *Client) WhoAmI(ctx context.Context) (*pb.Key, error) {
	res, err := c.Admin.WhoAmI(ctx, connect.NewRequest(&pb.WhoAmIRequest{}))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}
