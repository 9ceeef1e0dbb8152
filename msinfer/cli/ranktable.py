"""`msinfer ranktable generate | check | merge`: HCCL rank tables (RANK_TABLE_FILE)."""
from ..errors import MsinferError
from ..parallel import ranktable


def register(subparsers):
    parser = subparsers.add_parser(
        "ranktable", help="generate, check or merge HCCL rank tables (RANK_TABLE_FILE)")
    commands = parser.add_subparsers(dest="ranktable_command", metavar="ACTION", required=True)

    generate = commands.add_parser("generate", help="a rank table for this server's devices")
    generate.add_argument("devices", help="device ids: 0-3, 0,1,2,3 or [0,4)")
    generate.add_argument("--server-ip", help="this server's IPv4 address "
                                              "(default: the address of its default route)")
    source = generate.add_mutually_exclusive_group()
    source.add_argument("--device-ips", metavar="IP,IP,...",
                        help="device IPs in ascending device order")
    source.add_argument("--hccn-conf", metavar="PATH",
                        help="read the address_N= lines of this hccn.conf")
    source.add_argument("--no-device-ip", action="store_true",
                        help="write no device_ip (one server with 310P cards only)")
    generate.add_argument("-o", "--output", metavar="FILE",
                          help="default: hccl_{N}p_{ids}_{server_ip}.json as hccl_tools names it")
    generate.set_defaults(func=_generate_command)

    check = commands.add_parser("check", help="report every problem of a rank table")
    check.add_argument("file")
    check.add_argument("--strategy", metavar="YAML", help="the ranks must match its world_size")
    check.add_argument("--hardware", metavar="NAME",
                       help="device ids must lie within its devices per server")
    check.set_defaults(func=_check_command)

    merger = commands.add_parser("merge", help="one table for several servers")
    merger.add_argument("files", nargs="+", metavar="FILE")
    merger.add_argument("--sort", choices=["server_id"],
                        help="order servers by address instead of as given")
    merger.add_argument("-o", "--output", metavar="FILE",
                        help="default: hccl_{S}s_{N}p.json as merge_hccl names it")
    merger.set_defaults(func=_merge_command)


def _generate_command(args):
    devices = ranktable.parse_devices(args.devices)
    if args.server_ip:
        server_ip = args.server_ip
        print(f"server_id {server_ip}")
    else:
        server_ip = ranktable.host_ip()
        print(f"server_id {server_ip} (this host's address; --server-ip sets another)")
    if not ranktable.is_ipv4(server_ip):
        raise MsinferError(f"--server-ip {server_ip!r} is not an IPv4 address")

    device_ips, source = ranktable.find_device_ips(devices, args.device_ips, args.hccn_conf,
                                         args.no_device_ip)
    print(source)

    table = ranktable.build(devices, server_ip, device_ips)
    for device in table["server_list"][0]["device"]:
        print(f"  rank {device['rank_id']}: device {device['device_id']}"
              + (f", device_ip {device['device_ip']}" if "device_ip" in device else ""))
    path = args.output or ranktable.default_file_name(table)
    ranktable.write(table, path)
    print(f"wrote {path}")
    return 0


def _check_command(args):
    world_size = devices_per_server = None
    if args.strategy:
        # Imported here: the strategy and hardware modules are only needed for these options.
        from ..parallel.strategy import load_strategy
        world_size = load_strategy(args.strategy).world_size
    if args.hardware:
        from ..hardware import get_profile
        devices_per_server = get_profile(args.hardware).devices_per_server
    problems = ranktable.check_file(args.file, world_size, devices_per_server)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{args.file}: {len(problems)} problem{'s' if len(problems) > 1 else ''}")
        return 1
    table = ranktable.load(args.file)
    ranks = sum(len(server["device"]) for server in table["server_list"])
    print(f"{args.file}: ok ({len(table['server_list'])} server"
          f"{'s' if len(table['server_list']) > 1 else ''}, {ranks} ranks)")
    return 0


def _merge_command(args):
    # Not load(): merge takes the integer ids of older tools and writes them back as strings.
    tables = []
    for path in args.files:
        table, problems = ranktable.parse_file(path)
        ranktable.raise_problems(problems, path)
        tables.append(table)
    merged = ranktable.merge(tables, sources=args.files, sort_by=args.sort)
    path = args.output or ranktable.default_file_name(merged)
    ranktable.write(merged, path)
    first = 0
    for server in merged["server_list"]:
        last = first + len(server["device"]) - 1
        print(f"  server {server['server_id']}: ranks {first}..{last}")
        first = last + 1
    print(f"wrote {path}")
    return 0
