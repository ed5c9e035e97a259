// A loopback TCP proxy that can lose one answer: armed, it swallows the next chunk from
// the server of at least `minBytes` and cuts that connection, as a network that fails
// after the server committed and replied. Frozen, it forwards nothing either way, as a
// replica stopped with SIGSTOP. With `delayMs`, each answer is held that long, as a
// network that delivers late. With `reset`, a cut sends the client a TCP RST (a server
// killed, a middlebox dropping the connection) instead of closing it.
import { createServer, connect, type Server, type Socket, type AddressInfo } from "node:net";

export class LossyProxy {
  readonly endpoint: string;
  dropped = 0;
  frozen = false;
  delayMs = 0;
  reset = false;
  private armedFor: number | undefined;
  private readonly server: Server;
  private readonly sockets = new Set<Socket>();

  private constructor(server: Server, endpoint: string) {
    this.server = server;
    this.endpoint = endpoint;
  }

  static async start(upstream: string): Promise<LossyProxy> {
    const [host, port] = upstream.split(":");
    const state: { proxy?: LossyProxy } = {};
    const server = createServer((client) => {
      const server = connect(Number(port), host ?? "127.0.0.1");
      const proxy = (): LossyProxy | undefined => state.proxy;
      proxy()?.sockets.add(client).add(server);
      const cut = (): void => {
        client.destroy();
        server.destroy();
      };
      client.on("error", cut).on("close", cut);
      server.on("error", cut).on("close", cut);
      client.on("data", (chunk: Buffer) => {
        if (proxy()?.frozen !== true) server.write(chunk);
      });
      server.on("data", (chunk: Buffer) => {
        const p = proxy();
        if (p?.frozen === true) return;
        if (p?.armedFor !== undefined && chunk.length >= p.armedFor) {
          p.armedFor = undefined;
          p.dropped++;
          if (p.reset) client.resetAndDestroy();
          cut();
          return;
        }
        if (p !== undefined && p.delayMs > 0) setTimeout(() => client.write(chunk), p.delayMs);
        else client.write(chunk);
      });
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    state.proxy = new LossyProxy(server, `127.0.0.1:${(server.address() as AddressInfo).port}`);
    return state.proxy;
  }

  /** Loses the next answer of at least `minBytes`. */
  arm(minBytes: number): void {
    this.armedFor = minBytes;
  }

  async stop(): Promise<void> {
    for (const socket of this.sockets) socket.destroy();
    await new Promise((r) => this.server.close(r));
  }
}
