from genqueue.consumer.dashboard.command import dashboard_command

if __name__ == "__main__":
    dashboard_command(prog_name="consumer dashboard")
