//! The `outbox_db_pool_*` gauges of the pools' size, read from the pools at each scrape.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::outbox::store::Pools;

/// The size of the connection pools, read from them at each scrape.
#[derive(Debug)]
pub(super) struct PoolCollector {
    /// The pools it reads.
    pub(super) pools: Pools,
}

impl Collector for PoolCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let pools = [
            ("tenant", self.pools.tenant()),
            ("fleet", self.pools.fleet()),
        ];
        type Read = fn(&sqlx::PgPool) -> i64;
        let read: [(&str, &str, Read); 3] = [
            (
                "db_pool_connections",
                "Connections the pool holds open (idle and in use)",
                |p| i64::from(p.size()),
            ),
            (
                "db_pool_idle_connections",
                "Open connections of the pool that are idle",
                |p| p.num_idle() as i64,
            ),
            (
                "db_pool_max_connections",
                "Most connections the pool opens (OUTBOX_DATABASE__MAX_CONNECTIONS)",
                |p| i64::from(p.options().get_max_connections()),
            ),
        ];
        for (name, help, value) in read {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (label, pool) in pools {
                let labels = [("pool", label)];
                ConstGauge::new(value(pool)).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
