//! The few etcd calls the store makes, on the generated gRPC stubs (`proto/`): one channel
//! balanced over the cluster's members, and builders for the requests and transactions.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status, Streaming};

use super::proto::etcdserverpb::{
    compare, kv_client::KvClient, lease_client::LeaseClient, maintenance_client::MaintenanceClient,
    range_request, request_op, Compare, LeaseGrantRequest, LeaseKeepAliveRequest,
    LeaseKeepAliveResponse, LeaseRevokeRequest, PutRequest, RangeRequest, RangeResponse, RequestOp,
    StatusRequest, TxnRequest, TxnResponse,
};
use super::proto::v3electionpb::{election_client::ElectionClient, CampaignRequest, LeaderKey};

/// A client of one etcd cluster. Cloning shares the channel.
#[derive(Clone)]
pub(super) struct Client {
    channel: Channel,
}

/// The keepalive stream of one lease: renewals go in, acknowledgements come out.
pub(super) struct KeepAlive {
    requests: mpsc::Sender<LeaseKeepAliveRequest>,
    responses: Streaming<LeaseKeepAliveResponse>,
    id: i64,
}

/// A request that failed before etcd acted on it: the member could not be reached or the
/// connection broke, so it can be made again.
pub(super) fn not_sent(e: &Status) -> bool {
    match e.code() {
        Code::Unavailable => true,
        // The generated stubs report a channel that could not get ready so.
        Code::Unknown => e.message().starts_with("Service was not ready"),
        _ => false,
    }
}

impl Client {
    /// A channel over `endpoints` (`http://HOST:PORT` each); it connects on first use.
    pub fn new(endpoints: &[String], connect_timeout: Duration) -> Result<Self, String> {
        let mut list = Vec::with_capacity(endpoints.len());
        for e in endpoints {
            let endpoint = Endpoint::from_shared(e.clone())
                .map_err(|err| format!("endpoint {e}: {err}"))?
                .connect_timeout(connect_timeout)
                .tcp_nodelay(true);
            list.push(endpoint);
        }
        Ok(Self {
            channel: Channel::balance_list(list.into_iter()),
        })
    }

    /// Asks a member for its status: it answers once the cluster can be used.
    pub async fn status(&self) -> Result<(), Status> {
        let mut c = MaintenanceClient::new(self.channel.clone());
        c.status(StatusRequest {}).await.map(drop)
    }

    /// The keys from `key` (with every key under it when `prefix`), the oldest created first,
    /// at most `limit` of them (0: all).
    pub async fn get(&self, key: &[u8], prefix: bool, limit: i64) -> Result<RangeResponse, Status> {
        let request = RangeRequest {
            key: key.to_vec(),
            range_end: if prefix { prefix_end(key) } else { Vec::new() },
            limit,
            sort_order: range_request::SortOrder::Ascend as i32,
            sort_target: range_request::SortTarget::Create as i32,
            ..RangeRequest::default()
        };
        let mut c = KvClient::new(self.channel.clone());
        Ok(c.range(request).await?.into_inner())
    }

    pub async fn txn(&self, txn: TxnRequest) -> Result<TxnResponse, Status> {
        let mut c = KvClient::new(self.channel.clone());
        Ok(c.txn(txn).await?.into_inner())
    }

    /// A lease of `ttl_s` seconds: its id and the TTL etcd granted.
    pub async fn lease_grant(&self, ttl_s: i64) -> Result<(i64, i64), Status> {
        let mut c = LeaseClient::new(self.channel.clone());
        let request = LeaseGrantRequest { ttl: ttl_s, id: 0 };
        let granted = c.lease_grant(request).await?.into_inner();
        if !granted.error.is_empty() {
            return Err(Status::unknown(granted.error));
        }
        Ok((granted.id, granted.ttl))
    }

    pub async fn lease_revoke(&self, id: i64) -> Result<(), Status> {
        let mut c = LeaseClient::new(self.channel.clone());
        c.lease_revoke(LeaseRevokeRequest { id }).await.map(drop)
    }

    /// Opens the keepalive stream of lease `id` with a first renewal, and the TTL etcd
    /// answered it with (see [`KeepAlive::renew`]).
    pub async fn keep_alive(&self, id: i64) -> Result<(KeepAlive, Option<i64>), Status> {
        let (requests, rx) = mpsc::channel(4);
        // Queued before the call: etcd sends the stream's headers with its first answer, and
        // the call returns only once they arrive.
        let first = LeaseKeepAliveRequest { id };
        requests
            .try_send(first)
            .expect("an empty channel takes one request");
        let mut c = LeaseClient::new(self.channel.clone());
        let mut responses = c
            .lease_keep_alive(ReceiverStream::new(rx))
            .await?
            .into_inner();
        let ttl = responses.message().await?.map(|r| r.ttl);
        let stream = KeepAlive {
            requests,
            responses,
            id,
        };
        Ok((stream, ttl))
    }

    /// Waits until the key of `lease` is the oldest under the election `name`: the leader's key.
    pub async fn campaign(
        &self,
        name: &[u8],
        value: &[u8],
        lease: i64,
    ) -> Result<Option<LeaderKey>, Status> {
        let mut c = ElectionClient::new(self.channel.clone());
        let request = CampaignRequest {
            name: name.to_vec(),
            lease,
            value: value.to_vec(),
        };
        Ok(c.campaign(request).await?.into_inner().leader)
    }
}

impl KeepAlive {
    /// One renewal: the TTL etcd has left the lease (0 or less: the lease is gone), or `None`
    /// when the stream ended.
    pub async fn renew(&mut self) -> Result<Option<i64>, Status> {
        let request = LeaseKeepAliveRequest { id: self.id };
        if self.requests.send(request).await.is_err() {
            return Err(Status::unavailable("the keepalive stream closed"));
        }
        Ok(self.responses.message().await?.map(|r| r.ttl))
    }
}

/// The end of the range of every key starting with `prefix`: the prefix with its last byte
/// below 0xff raised by one.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: to the end of the key space.
    vec![0]
}

/// Compares for transactions: the key's version, or the revision that created it, is `value`.
pub(super) fn version_is(key: &[u8], version: i64) -> Compare {
    let value = compare::TargetUnion::Version(version);
    equal(key, compare::CompareTarget::Version, value)
}

pub(super) fn created_at(key: &[u8], revision: i64) -> Compare {
    let value = compare::TargetUnion::CreateRevision(revision);
    equal(key, compare::CompareTarget::Create, value)
}

fn equal(key: &[u8], target: compare::CompareTarget, value: compare::TargetUnion) -> Compare {
    Compare {
        result: compare::CompareResult::Equal as i32,
        target: target as i32,
        key: key.to_vec(),
        range_end: Vec::new(),
        target_union: Some(value),
    }
}

/// Operations for transactions.
pub(super) fn put(key: &[u8], value: Vec<u8>) -> RequestOp {
    let put = PutRequest {
        key: key.to_vec(),
        value,
        ..PutRequest::default()
    };
    RequestOp {
        request: Some(request_op::Request::RequestPut(put)),
    }
}

pub(super) fn get(key: &[u8]) -> RequestOp {
    let range = RangeRequest {
        key: key.to_vec(),
        ..RangeRequest::default()
    };
    RequestOp {
        request: Some(request_op::Request::RequestRange(range)),
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_range_ends_past_every_key_under_it() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
