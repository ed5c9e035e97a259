//! A real browser for the console's tests: the system's chromium, headless, driven by its
//! chromedriver over WebDriver (Debian: `apt-get install chromium chromium-driver`).

use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::sync::Semaphore;

/// Browsers at once: each is a chromium, and the machine has two cores.
static BROWSERS: Semaphore = Semaphore::const_new(2);

pub struct Browser {
    pub client: Client,
    base: String,
    _driver: Child,
    _permit: tokio::sync::SemaphorePermit<'static>,
}

impl Browser {
    /// A fresh browser (no cookies) pointed at the console at `addr`.
    pub async fn open(addr: std::net::SocketAddr) -> Self {
        Self::start(format!("http://{addr}"), false).await
    }

    /// A fresh browser at the console at `addr`, signed in with `key`.
    pub async fn signed_in(addr: std::net::SocketAddr, key: &str) -> Self {
        let browser = Self::open(addr).await;
        browser.sign_in(key).await;
        browser
    }

    /// The same over HTTPS, trusting the test's own certificate authority's certificate.
    pub async fn open_https(addr: std::net::SocketAddr) -> Self {
        Self::start(format!("https://localhost:{}", addr.port()), true).await
    }

    async fn start(base: String, insecure: bool) -> Self {
        let permit = BROWSERS.acquire().await.unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // A process group of its own: a failed test must not leave its chromium running.
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("chromedriver is needed: apt-get install chromium chromium-driver");
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".to_owned(),
            json!({ "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                             "--disable-dev-shm-usage", "--window-size=1280,1000"] }),
        );
        capabilities.insert("acceptInsecureCerts".to_owned(), json!(insecure));
        let deadline = Instant::now() + Duration::from_secs(60);
        let client = loop {
            let connected =
                ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                    .capabilities(capabilities.clone())
                    .connect(&format!("http://127.0.0.1:{port}"))
                    .await;
            match connected {
                Ok(client) => break client,
                Err(e) => {
                    assert!(Instant::now() < deadline, "chromedriver did not start: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        Self {
            client,
            base,
            _driver: driver,
            _permit: permit,
        }
    }

    pub async fn goto(&self, path: &str) {
        self.client
            .goto(&format!("{}{path}", self.base))
            .await
            .unwrap();
    }

    /// The path of the page shown.
    pub async fn path(&self) -> String {
        self.client.current_url().await.unwrap().path().to_owned()
    }

    pub async fn text(&self, css: &str) -> String {
        match self.client.find(Locator::Css(css)).await {
            Ok(element) => element.text().await.unwrap(),
            Err(e) => panic!("{css} is not on {}: {e}", self.path().await),
        }
    }

    /// The element's markup, as the browser serializes it.
    pub async fn html(&self, css: &str) -> String {
        match self.client.find(Locator::Css(css)).await {
            Ok(element) => element.html(false).await.unwrap(),
            Err(e) => panic!("{css} is not on {}: {e}", self.path().await),
        }
    }

    /// The visible text of the whole page.
    pub async fn body(&self) -> String {
        self.text("body").await
    }

    pub async fn fill(&self, css: &str, value: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap()
            .send_keys(value)
            .await
            .unwrap();
    }

    pub async fn click(&self, css: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
    }

    /// Clicks what sends a form or follows a link, and waits until the browser has left
    /// the page: the click may return before the navigation it starts.
    pub async fn submit(&self, css: &str) {
        self.leave_by(Locator::Css(css)).await;
    }

    /// [`Self::submit`] for an element found by XPath.
    pub async fn submit_xpath(&self, xpath: &str) {
        self.leave_by(Locator::XPath(xpath)).await;
    }

    async fn leave_by(&self, locator: Locator<'_>) {
        let page = self.client.find(Locator::Css("html")).await.unwrap();
        self.client
            .find(locator)
            .await
            .unwrap_or_else(|e| panic!("{locator:?}: {e}"))
            .click()
            .await
            .unwrap();
        // The old page's root goes stale once the browser has left it; chromium may first
        // answer that it is not in the document, so other errors are asked again.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let why = match page.tag_name().await {
                Err(e) if e.is_stale_element_reference() => break,
                Err(e) => e.to_string(),
                Ok(_) => "still on the page".to_owned(),
            };
            assert!(
                Instant::now() < deadline,
                "after clicking {locator:?}: {why}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn select(&self, css: &str, value: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap()
            .select_by_value(value)
            .await
            .unwrap();
    }

    /// Runs `script` in the page (to tamper with a form as a hostile page could).
    pub async fn run(&self, script: &str) {
        self.client.execute(script, vec![]).await.unwrap();
    }

    pub async fn sign_in(&self, key: &str) {
        self.goto("/sign-in").await;
        self.fill("#key", key).await;
        self.submit("#sign-in").await;
    }

    /// Saves the page as `<name>.png` in `OUTBOX_SCREENSHOTS_DIR`, or under `target/`:
    /// the committed ones in docs/console are made by this with that variable set.
    pub async fn screenshot(&self, name: &str) {
        let dir = std::env::var_os("OUTBOX_SCREENSHOTS_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/console-screenshots")
            });
        std::fs::create_dir_all(&dir).unwrap();
        let png = self.client.screenshot().await.unwrap();
        std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
    }

    pub async fn close(self) {
        self.client.clone().close().await.unwrap();
    }
}

impl Drop for Browser {
    /// chromedriver's chromium outlives a killed chromedriver: end its whole group.
    fn drop(&mut self) {
        // killpg, not `kill -KILL -<pid>`: procps' kill reads that as kill(-1), every
        // process the user may signal.
        let group = self
            ._driver
            .id()
            .and_then(|pid| rustix::process::Pid::from_raw(i32::try_from(pid).ok()?));
        if let Some(group) = group {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
    }
}
