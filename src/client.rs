//! A ready-made gRPC client for outboxd that sends the API key (and, for keys bound to
//! several tenants, the tenant) with every call: used by the CLI, the tests and the bench.

use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::auth::TENANT_HEADER;
use crate::proto::v1::outbox_service_client::OutboxServiceClient;

/// Adds `authorization: Bearer <key>` and `x-outbox-tenant` to each request.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    authorization: Option<AsciiMetadataValue>,
    tenant: Option<AsciiMetadataValue>,
}

impl Credentials {
    /// Credentials for an API key, optionally acting for one tenant.
    ///
    /// # Errors
    /// The key or tenant contains characters metadata cannot carry.
    pub fn new(api_key: Option<&str>, tenant: Option<&str>) -> Result<Self, Status> {
        let value = |s: String| {
            MetadataValue::try_from(s).map_err(|_| {
                Status::invalid_argument(
                    "holds a character gRPC metadata cannot carry (printable ASCII only)",
                )
            })
        };
        Ok(Self {
            authorization: api_key.map(|k| value(format!("Bearer {k}"))).transpose()?,
            tenant: tenant.map(|t| value(t.to_owned())).transpose()?,
        })
    }
}

impl Interceptor for Credentials {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(a) = &self.authorization {
            request.metadata_mut().insert("authorization", a.clone());
        }
        if let Some(t) = &self.tenant {
            request.metadata_mut().insert(TENANT_HEADER, t.clone());
        }
        Ok(request)
    }
}

/// The generated client with credentials attached.
pub type Client = OutboxServiceClient<InterceptedService<Channel, Credentials>>;

/// A client over `channel` sending `credentials`.
pub fn client(channel: Channel, credentials: Credentials) -> Client {
    // Replies of any size: the server bounds them (OUTBOX_LIMITS__MAX_REPLY_BYTES).
    OutboxServiceClient::with_interceptor(channel, credentials)
        .max_decoding_message_size(usize::MAX)
}
