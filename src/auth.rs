//! Authentication and authorization: bearer API keys mapped to tenants, scopes and
//! regions. Keys are random 256-bit secrets, so a plain SHA-256 is all the storage needs
//! (no password stretching); the server only ever holds their hashes.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use sqlx::PgPool;
use tonic::metadata::MetadataMap;

use crate::outbox::store::{self, ApiKeyRecord, SettleScope, TenantScope};
use crate::outbox::{Error, Reason, Result};

/// Metadata naming the tenant a request acts for, for keys bound to several tenants.
pub const TENANT_HEADER: &str = "x-outbox-tenant";

/// Prefix of every API key, so leaked keys are easy to recognise and scan for.
pub const KEY_PREFIX: &str = "obx_";

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Permission {
    /// Enqueue.
    Produce,
    /// Claim, ExtendLease, MarkSubmitted, Ack, Fail.
    Consume,
    /// Reconcile and inspection.
    Operate,
    /// Everything.
    Admin,
}

impl Permission {
    /// Every scope name, as stored.
    pub const NAMES: [&'static str; 4] = ["produce", "consume", "operate", "admin"];

    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Produce => "produce",
            Self::Consume => "consume",
            Self::Operate => "operate",
            Self::Admin => "admin",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "produce" => Some(Self::Produce),
            "consume" => Some(Self::Consume),
            "operate" => Some(Self::Operate),
            "admin" => Some(Self::Admin),
            _ => None,
        }
    }
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Key id: what a Claim's request id is bound to.
    pub key_id: uuid::Uuid,
    /// Key name, for logs.
    pub key_name: String,
    /// Tenants it acts for.
    pub tenants: TenantScope,
    /// Scopes granted.
    pub permissions: Vec<Permission>,
    /// Regions it is limited to (empty: any).
    pub regions: Vec<String>,
}

impl Caller {
    /// The caller a stored key makes (its unknown scopes ignored).
    pub fn from_record(r: ApiKeyRecord) -> Self {
        Self {
            key_id: r.id,
            key_name: r.name,
            tenants: if r.all_tenants {
                TenantScope::All
            } else {
                TenantScope::Tenants(r.tenants)
            },
            permissions: r
                .scopes
                .iter()
                .filter_map(|s| Permission::parse(s))
                .collect(),
            regions: r.regions,
        }
    }

    /// Fails unless the key has `permission` (or `admin`).
    ///
    /// # Errors
    /// [`Error::PermissionDenied`] with reason `MISSING_SCOPE`.
    pub fn require(&self, permission: Permission) -> Result<()> {
        if self.permissions.contains(&permission) || self.permissions.contains(&Permission::Admin) {
            Ok(())
        } else {
            Err(Error::PermissionDenied(
                Reason::MissingScope,
                format!(
                    "API key {:?} lacks the {:?} scope this call needs",
                    self.key_name,
                    permission.as_str()
                ),
            ))
        }
    }

    /// Fails when the key is limited to regions and `region` is not one of them (an empty
    /// region, meaning "any", is not within a limited key's reach either).
    ///
    /// # Errors
    /// [`Error::PermissionDenied`] with reason `REGION_NOT_ALLOWED`.
    pub fn require_region(&self, field: &str, region: &str) -> Result<()> {
        if self.regions.is_empty() || self.regions.iter().any(|r| r == region) {
            return Ok(());
        }
        Err(Error::PermissionDenied(
            Reason::RegionNotAllowed,
            format!(
                "{field} {region:?} is outside the regions of API key {:?} ({})",
                self.key_name,
                self.regions.join(", ")
            ),
        ))
    }

    /// Whose settles these are: `tenants` (this request's), within this key's regions.
    pub fn settling<'a>(&'a self, tenants: &'a TenantScope) -> SettleScope<'a> {
        SettleScope {
            tenants,
            key_regions: &self.regions,
        }
    }

    /// The tenants this request acts for: the one named by the `x-outbox-tenant` header
    /// (which must be one of the key's), or all of the key's.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a header given twice; [`Error::PermissionDenied`]
    /// with reason `TENANT_NOT_ALLOWED`.
    pub fn scope(&self, metadata: &MetadataMap) -> Result<TenantScope> {
        let Some(value) = metadata.get(TENANT_HEADER) else {
            return Ok(self.tenants.clone());
        };
        if metadata.get_all(TENANT_HEADER).iter().nth(1).is_some() {
            return Err(Error::InvalidArgument(vec![
                crate::outbox::FieldViolation::new(
                    TENANT_HEADER,
                    "given more than once: name one tenant",
                ),
            ]));
        }
        let denied = || {
            Error::PermissionDenied(
                Reason::TenantNotAllowed,
                format!(
                    "API key {:?} may not act for the tenant named in {TENANT_HEADER}",
                    self.key_name
                ),
            )
        };
        let tenant = value.to_str().map_err(|_| denied())?;
        let allowed = match &self.tenants {
            TenantScope::All => crate::outbox::is_name(tenant, 64),
            TenantScope::Tenants(t) => t.iter().any(|t| t == tenant),
        };
        if allowed {
            Ok(TenantScope::one(tenant))
        } else {
            Err(denied())
        }
    }
}

/// A new key: the secret, shown once, and what is stored.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// The bearer secret (`obx_…`).
    pub secret: String,
    /// Its SHA-256.
    pub hash: [u8; 32],
    /// Its first characters.
    pub prefix: String,
}

/// Mints a random key.
///
/// # Errors
/// The operating system's random source failed.
pub fn generate_key() -> std::result::Result<NewKey, getrandom::Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)?;
    let secret = format!("{KEY_PREFIX}{}", hex::encode(bytes));
    Ok(NewKey {
        hash: hash_key(&secret),
        prefix: secret[..KEY_PREFIX.len() + 8].to_owned(),
        secret,
    })
}

/// Why `name` cannot name a key, if it cannot: one the CLI and the console refuse alike.
pub fn key_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() || name.len() > MAX_KEY_NAME_BYTES {
        Some("a key needs a name of 1-200 bytes")
    } else if name.chars().any(char::is_control) {
        Some("a key's name has no control characters")
    } else {
        None
    }
}

/// Longest key name.
const MAX_KEY_NAME_BYTES: usize = 200;

/// Mints a key named `name` for `tenants` (`None`: every tenant) with `scopes` and
/// `regions` (empty: any), stores its hash through `owner` (the schema owner), and returns
/// what was stored and the secret, which exists nowhere else.
///
/// # Errors
/// The random source failed, or the key could not be stored.
pub async fn issue_key(
    owner: &PgPool,
    name: &str,
    tenants: Option<Vec<String>>,
    scopes: Vec<String>,
    regions: Vec<String>,
) -> anyhow::Result<(ApiKeyRecord, String)> {
    let key = generate_key()?;
    let record = key_record(&key, name, tenants, scopes, regions);
    store::insert_api_key(owner, &record, &key.hash).await?;
    Ok((record, key.secret))
}

/// Fewest characters after [`KEY_PREFIX`] in a key chosen by an operator: 128 bits of hex
/// (a minted key has 64).
pub const SUPPLIED_KEY_MIN_LENGTH: usize = 32;

/// A key chosen by an operator (e.g. `obx_$(openssl rand -hex 32)`, kept in a Kubernetes
/// Secret before the key exists in the database): [`KEY_PREFIX`] and at least
/// [`SUPPLIED_KEY_MIN_LENGTH`] ASCII letters, digits, `-` or `_`, what a bearer header
/// carries unchanged.
///
/// # Errors
/// Any other secret (the error never contains it).
pub fn supplied_key(secret: &str) -> anyhow::Result<NewKey> {
    let rest = secret.strip_prefix(KEY_PREFIX).unwrap_or_default();
    anyhow::ensure!(
        rest.len() >= SUPPLIED_KEY_MIN_LENGTH
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "the supplied key must be {KEY_PREFIX} followed by at least {SUPPLIED_KEY_MIN_LENGTH} \
         letters, digits, - or _ (e.g. {KEY_PREFIX}$(openssl rand -hex 32))"
    );
    Ok(NewKey {
        hash: hash_key(secret),
        prefix: secret[..KEY_PREFIX.len() + 8].to_owned(),
        secret: secret.to_owned(),
    })
}

/// Stores `key` (see [`supplied_key`]) as [`issue_key`] stores a minted one, unless a key
/// with the same secret is stored already, live or revoked; then nothing changes, so a
/// deployment may run this on every install and upgrade. Returns what would be stored and
/// whether it was stored now.
///
/// # Errors
/// The key could not be stored.
pub async fn store_supplied_key(
    owner: &PgPool,
    key: &NewKey,
    name: &str,
    tenants: Option<Vec<String>>,
    scopes: Vec<String>,
    regions: Vec<String>,
) -> anyhow::Result<(ApiKeyRecord, bool)> {
    let record = key_record(key, name, tenants, scopes, regions);
    let stored = store::insert_api_key_unless_stored(owner, &record, &key.hash).await?;
    Ok((record, stored))
}

fn key_record(
    key: &NewKey,
    name: &str,
    tenants: Option<Vec<String>>,
    scopes: Vec<String>,
    regions: Vec<String>,
) -> ApiKeyRecord {
    ApiKeyRecord {
        id: uuid::Uuid::now_v7(),
        name: name.to_owned(),
        prefix: key.prefix.clone(),
        all_tenants: tenants.is_none(),
        tenants: tenants.unwrap_or_default(),
        scopes,
        regions,
        created_at: chrono::Utc::now(),
        revoked_at: None,
    }
}

/// SHA-256 of a key.
pub fn hash_key(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// Resolves bearer keys to callers, caching lookups (revocation takes effect within the TTL).
#[derive(Debug)]
pub struct Authenticator {
    pool: PgPool,
    ttl: Duration,
    cache: Mutex<KeyCache>,
    /// Permits to look a key up in the database: every distinct unknown key costs a
    /// lookup, so a flood of made-up keys could otherwise hold every pooled connection.
    lookups: tokio::sync::Semaphore,
    /// Permits to look up again a key that was valid when last looked up (its entry is
    /// stale): its refresh never queues behind a flood of made-up keys on `lookups`.
    refreshes: tokio::sync::Semaphore,
}

/// Most key lookups in the database at once (each [`Authenticator`] holds a semaphore of
/// them, and as many again for refreshing keys that were valid): they take a millisecond,
/// and known keys are cached, so a few are enough for a cold start.
pub const CONCURRENT_LOOKUPS: usize = 2;

/// Key hash → the caller it resolved to (or none) and when it was looked up.
type KeyCache = HashMap<[u8; 32], (Option<Caller>, Instant)>;

/// Most cached lookups; beyond it unknown keys are dropped, then real keys unused for ten
/// TTLs, and the whole cache only if real keys alone still fill it (bad keys must not grow
/// memory, nor evict real keys: a flood of made-up keys would otherwise send every caller
/// to the database, behind the flood).
const CACHE_LIMIT: usize = 10_000;

impl Authenticator {
    /// An authenticator reading keys through `pool`.
    pub fn new(pool: PgPool, ttl: Duration) -> Self {
        Self {
            pool,
            ttl,
            cache: Mutex::new(HashMap::new()),
            lookups: tokio::sync::Semaphore::new(CONCURRENT_LOOKUPS),
            refreshes: tokio::sync::Semaphore::new(CONCURRENT_LOOKUPS),
        }
    }

    /// How long a looked-up key is trusted before it is read again.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The caller presenting `authorization: Bearer <key>`.
    ///
    /// # Errors
    /// [`Error::Unauthenticated`] for a missing, malformed, unknown or revoked key;
    /// [`Error::Database`] when keys cannot be read.
    pub async fn authenticate(&self, metadata: &MetadataMap) -> Result<Caller> {
        let unauthenticated = |why: &str| Error::Unauthenticated(why.to_owned());
        // Two keys would leave which one acts to the order of the headers.
        if metadata.get_all("authorization").iter().nth(1).is_some() {
            return Err(unauthenticated(
                "`authorization` given more than once: send one API key",
            ));
        }
        let header = metadata
            .get("authorization")
            .ok_or_else(|| unauthenticated("missing `authorization: Bearer <API key>` metadata"))?;
        let secret = header
            .to_str()
            .ok()
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|s| s.starts_with(KEY_PREFIX))
            .ok_or_else(|| unauthenticated("authorization must be `Bearer obx_…`"))?;
        self.resolve(secret).await
    }

    /// The caller whose key is `secret`, read from the database now, not from the cache:
    /// a console sign-in must not outlive the key's revocation by the cache's TTL.
    ///
    /// # Errors
    /// As [`Self::authenticate`].
    pub async fn resolve_now(&self, secret: &str) -> Result<Caller> {
        self.lookup(secret, false).await
    }

    async fn resolve(&self, secret: &str) -> Result<Caller> {
        self.lookup(secret, true).await
    }

    /// Waits for one of the unknown keys' lookup permits, for another credential read
    /// from the database (a console session's cookie): a flood of made-up cookies then
    /// holds no more pooled connections than a flood of made-up keys.
    pub async fn lookup_permit(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        // Never closed, so acquiring only waits.
        self.lookups.acquire().await.ok()
    }

    async fn lookup(&self, secret: &str, cached: bool) -> Result<Caller> {
        let hash = hash_key(secret);
        let (fresh, was_valid) = self.cached(&hash);
        let caller = match fresh.filter(|_| cached) {
            Some(caller) => caller,
            None => {
                let permits = if was_valid {
                    &self.refreshes
                } else {
                    &self.lookups
                };
                // Never closed, so acquiring only waits.
                let _permit = permits.acquire().await.ok();
                // A call that held a permit before this one may have looked it up.
                match self.cached(&hash).0.filter(|_| cached) {
                    Some(caller) => caller,
                    None => self.look_up_now(hash).await?,
                }
            }
        };
        caller.ok_or_else(|| Error::Unauthenticated("unknown or revoked API key".to_owned()))
    }

    /// The lookup of `hash` in the cache, if younger than the TTL, and whether the last
    /// lookup of it found a valid key.
    fn cached(&self, hash: &[u8; 32]) -> (Option<Option<Caller>>, bool) {
        match self.lock().get(hash) {
            Some((caller, at)) => (
                (at.elapsed() < self.ttl).then(|| caller.clone()),
                caller.is_some(),
            ),
            None => (None, false),
        }
    }

    /// Reads the key of `hash` from the database and caches what it found.
    async fn look_up_now(&self, hash: [u8; 32]) -> Result<Option<Caller>> {
        let caller = store::lookup_api_key(&self.pool, &hash)
            .await?
            .map(Caller::from_record);
        let mut cache = self.lock();
        if cache.len() >= CACHE_LIMIT {
            // Unknown keys go first, then real keys unused for ten TTLs (rotated, revoked):
            // a stale real key that is still used refreshes on `refreshes`.
            let horizon = self.ttl * 10;
            cache.retain(|_, (caller, at)| caller.is_some() && at.elapsed() < horizon);
            if cache.len() >= CACHE_LIMIT {
                cache.clear();
            }
        }
        cache.insert(hash, (caller.clone(), Instant::now()));
        Ok(caller)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, KeyCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}
